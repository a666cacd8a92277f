"""Compiles recorded Triton launches for an H200 (sm_90) on a machine without a GPU: Triton's
interpreter runs a kernel's Python, not its compilation, so a kernel that would not compile (a
loop-carried value changing shape, a type the hardware path rejects) passes there and fails on
the GPU. Each launch is kept as its kernel's module and name, argument types, constexprs and warps.

Run as `python -m tests.cuda.sm90 launches.json`, in a process without TRITON_INTERPRET (the
kernels' helpers must be compiled functions), with PDL's wait compiled in as on the GPU."""
from __future__ import annotations

import importlib
import inspect
import json
import sys
from concurrent.futures import ProcessPoolExecutor

TARGET = ("cuda", 90, 32)
LAUNCHES: set[str] = set()     # this test session's launches (conftest.py records them when interpreted)


def launch_record(kernel, args: tuple, meta: dict) -> str:
    """One launch as a JSON key: its kernel, argument types (as Triton mangles them), constexprs, warps."""
    from triton.runtime.jit import mangle_type
    fn = kernel.fn
    params = inspect.signature(fn).parameters
    values = dict(zip(params, args)) | {k: v for k, v in meta.items() if k in params}
    constexpr = {name for name, p in params.items() if "constexpr" in str(p.annotation)}
    return json.dumps({"module": fn.__module__, "kernel": fn.__name__, "num_warps": meta.get("num_warps", 4),
                       "signature": {n: "constexpr" if n in constexpr else mangle_type(v) for n, v in values.items()},
                       "constexprs": {n: values[n] for n in constexpr if n in values}}, sort_keys=True)


def compile_one(record: str) -> str | None:
    """None if the launch compiles for sm_90, else the compiler's complaint."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from soma_runtime.backends.cuda import chain
    chain.WAIT = tl.constexpr(True)                         # as on an H200: PDL's wait compiled in
    r = json.loads(record)
    kernel = getattr(importlib.import_module(r["module"]), r["kernel"])
    try:
        triton.compile(ASTSource(kernel.kernel, r["signature"], r["constexprs"]), target=GPUTarget(*TARGET),
                       options={"num_warps": r["num_warps"]})
    except Exception as e:                                  # noqa: BLE001  (any failure is the finding)
        return f"{r['module']}.{r['kernel']} {r['constexprs']} warps {r['num_warps']}: {type(e).__name__}: {str(e)[-1500:]}"
    return None


def main(path: str) -> int:
    with open(path) as f:
        records = json.load(f)
    with ProcessPoolExecutor() as pool:
        failures = [f for f in pool.map(compile_one, records) if f]
    for f in failures:
        print(f, file=sys.stderr)
    print(f"{len(records) - len(failures)} of {len(records)} launches compile for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

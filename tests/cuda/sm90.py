"""Compiles recorded Triton launches for an H200 (sm_90) on a machine without a GPU: Triton's
interpreter runs a kernel's Python, not its compilation, so a kernel that would not compile (a
loop-carried value changing shape, a type the hardware path rejects) passes there and fails on
the GPU. A kernel that spills registers to memory fails too: it compiles and runs, only slowly (the
decode attention once spilled 600 bytes at 128-wide heads, a third of its time on an H200, unseen),
except the dense tiled matmuls (TIMED_TILES), whose tiles were chosen by timing on an H200, spills and all.
Each launch is kept as its kernel's module and name, argument types, constexprs, warps and stages.

Run as `python -m tests.cuda.sm90 launches.json`, in a process without TRITON_INTERPRET (the
kernels' helpers must be compiled functions), with PDL's wait compiled in as on the GPU."""
from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

TARGET = ("cuda", 90, 32)
TIMED_TILES = {"_matmul_kernel", "_skinny_matmul_kernel"}      # kernels whose spills were timed (tile sweeps)
LAUNCHES: set[str] = set()     # this test session's launches (conftest.py records them when interpreted)


def launch_record(kernel, args: tuple, meta: dict) -> str:
    """One launch as a JSON key: its kernel, argument types (as Triton mangles them), constexprs, warps."""
    from triton.runtime.jit import mangle_type
    fn = kernel.fn
    params = inspect.signature(fn).parameters
    values = dict(zip(params, args)) | {k: v for k, v in meta.items() if k in params}
    constexpr = {name for name, p in params.items() if "constexpr" in str(p.annotation)}
    return json.dumps({"module": fn.__module__, "kernel": fn.__name__, "num_warps": meta.get("num_warps", 4),
                       "num_stages": meta.get("num_stages", 3),
                       "signature": {n: "constexpr" if n in constexpr else mangle_type(v) for n, v in values.items()},
                       "constexprs": {n: values[n] for n in constexpr if n in values}}, sort_keys=True)


def spilled_bytes(ptx: str) -> int:
    """Bytes a kernel's registers spill to local memory: Triton's own ptxas, verbose, on its PTX."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([get_ptxas(TARGET[1]).path, "-v", f"--gpu-name={sm_arch_from_capability(TARGET[1])}", f.name,
                              "-o", "/dev/null"], capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


def compile_one(record: str) -> str | None:
    """None if the launch compiles for sm_90 without spilling registers, else what went wrong."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from soma_runtime.backends.cuda import chain
    chain.WAIT = tl.constexpr(True)                         # as on an H200: PDL's wait compiled in
    r = json.loads(record)
    kernel = getattr(importlib.import_module(r["module"]), r["kernel"])
    launch = f"{r['module']}.{r['kernel']} {r['constexprs']} warps {r['num_warps']}"
    try:
        compiled = triton.compile(ASTSource(kernel.kernel, r["signature"], r["constexprs"]), target=GPUTarget(*TARGET),
                                  options={"num_warps": r["num_warps"], "num_stages": r.get("num_stages", 3)})
        spilled = 0 if r["kernel"] in TIMED_TILES else spilled_bytes(compiled.asm["ptx"])
    except Exception as e:                                  # noqa: BLE001  (any failure is the finding)
        return f"{launch}: {type(e).__name__}: {str(e)[-1500:]}"
    return f"{launch}: spills {spilled} bytes of registers" if spilled else None


def main(path: str) -> int:
    with open(path) as f:
        records = json.load(f)
    with ProcessPoolExecutor() as pool:
        failures = [f for f in pool.map(compile_one, records) if f]
    for f in failures:
        print(f, file=sys.stderr)
    print(f"{len(records) - len(failures)} of {len(records)} launches compile for sm_90 without spilling")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

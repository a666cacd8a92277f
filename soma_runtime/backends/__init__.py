"""Backends: one package each, whose `BACKEND` object (ir.backend.Backend) is its one public surface.

The runtime names a backend ("reference", "cpu", "cuda") and gets its object here; importing the
package registers its jets. Nothing outside this package imports a backend's own modules.
"""
from __future__ import annotations

import importlib
import os

import numpy as np

from soma_runtime.ir.backend import Backend

BACKENDS = ("reference", "cpu", "cuda")


def get(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    return importlib.import_module(f"soma_runtime.backends.{name}").BACKEND


def gpu_available() -> bool:
    """A real CUDA device (not the Triton interpreter): what `--backend auto` looks for. Without the
    NVIDIA driver's device node, torch is not even imported (it takes seconds)."""
    if not os.path.exists("/dev/nvidiactl"):
        return False
    info = detect_all().get("cuda", {})
    return bool(info.get("available")) and "device" in info


def detect_all() -> dict[str, dict]:
    """What each backend found on this machine (for `soma-runtime backends`)."""
    report = {}
    for name in BACKENDS:
        try:
            report[name] = get(name).detect()
        except (ImportError, OSError, RuntimeError) as e:  # a missing driver is reported, not raised
            report[name] = {"available": False, "error": f"{type(e).__name__}: {e}"}
    return report


def run_op(op: str, *inputs, backend: str = "cpu", **attrs):
    """Run one op eagerly on a backend, results back on the host (tests and benchmarks)."""
    from soma_runtime.ir.graph import meta_of
    from soma_runtime.ir.jets import REGISTRY
    from soma_runtime.ir.ops import OPS
    target = get(backend)
    opdef = OPS[op]
    inputs = opdef.pad(inputs)
    metas = [None if x is None else meta_of(x) for x in inputs]
    opdef.infer(metas, attrs, op)
    with np.errstate(all="ignore"):
        result = REGISTRY.kernel_for(opdef, metas, attrs, target)(*inputs, **opdef.full_attrs(attrs))
    return tuple(target.fetch(r) for r in result) if isinstance(result, tuple) else target.fetch(result)

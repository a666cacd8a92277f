"""Backends: one package each, exposing jets through the registry plus a `detect()` report.

The runtime names a backend ("reference", "cpu", "cuda") and never imports its modules itself:
`load_backend` imports the package once, which registers its jets. A backend whose tensors live
off the host also gives `place` (host value -> its memory), `fetch` (back), `zeros`, and the
`FALLBACK` backend that runs ops it has no jet for.
"""
from __future__ import annotations

import importlib
import os

BACKENDS = ("reference", "cpu", "cuda")


def load_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    return importlib.import_module(f"soma_runtime.backends.{name}")


def place(backend: str, value):
    return getattr(load_backend(backend), "place", _same)(value)


def fetch(backend: str, value):
    return getattr(load_backend(backend), "fetch", _same)(value)


def _same(value):
    return value


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
            report[name] = load_backend(name).detect()
        except (ImportError, OSError, RuntimeError) as e:  # a missing driver is reported, not raised
            report[name] = {"available": False, "error": f"{type(e).__name__}: {e}"}
    return report

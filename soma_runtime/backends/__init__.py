"""Backends: one package each, exposing jets through the registry plus a `detect()` report.

The runtime names a backend ("reference", "cpu", "cuda") and never imports its modules itself:
`load_backend` imports the package once, which registers its jets.
"""
from __future__ import annotations

import importlib

BACKENDS = ("reference", "cpu")


def load_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    return importlib.import_module(f"soma_runtime.backends.{name}")


def detect_all() -> dict[str, dict]:
    """What each backend found on this machine (for `soma-runtime backends`)."""
    report = {}
    for name in BACKENDS:
        try:
            report[name] = load_backend(name).detect()
        except (ImportError, OSError, RuntimeError) as e:  # a missing driver is reported, not raised
            report[name] = {"available": False, "error": f"{type(e).__name__}: {e}"}
    return report

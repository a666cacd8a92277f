"""Where each op runs (SPEC "scheduling"): the op -> backend policy.

Level 0, static rules: a backend runs every op it has a jet for, and the ops it has none for on its
fallback (the host), each said once in the log (ir/jets.py). Level 1, capability detection: `auto`
is CUDA where a GPU is present, else the CPU. Level 2, the autotune dispatch table: some ops have
several correct kernels whose speed depends on the machine; a backend times them per shape (its
`prepare`) and keeps the winners (the CPU's table: backends/cpu/autotune.py).
"""
from __future__ import annotations

from soma_runtime.backends import BACKENDS, detect_all, get, gpu_available
from soma_runtime.errors import RequestError
from soma_runtime.ir.backend import Backend


def check_backend(requested: str) -> str:
    """The backend `requested` names here ("auto": cuda where a GPU is present, else cpu); RequestError
    for an unknown name or an unavailable one."""
    if requested == "auto":
        return "cuda" if gpu_available() else "cpu"
    if requested not in BACKENDS:
        raise RequestError(f"unknown backend {requested!r}; known: auto, {', '.join(BACKENDS)}")
    if requested == "cuda" and not (cuda := detect_all()["cuda"]).get("available"):
        raise RequestError(f"the cuda backend is not available here: {cuda.get('error')}")
    return requested


def detect() -> dict[str, dict]:
    """What each backend found on this machine."""
    return detect_all()


def use_threads(threads: int | None) -> None:
    """The CPU (every backend's fallback) computes on `threads` threads (default: its physical cores)."""
    get("cpu").use_threads(threads)


def backend_named(name: str) -> Backend:
    """The Backend `name` (from `check_backend`) stands for: a model of any task runs where it was asked to."""
    return get(name)


def threads() -> int | None:
    """The CPU's thread count as set (None: its default)."""
    return get("cpu").threads

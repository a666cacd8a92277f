"""Where each op runs (SPEC "scheduling"): the op -> backend policy.

Level 0, static rules: a backend runs every op it has a jet for, and the ops it has none for on its
fallback (the host), each said once in the log (ir/jets.py); models of a task with no device kernels
yet (encoders: attention over whole sequences) run on the CPU. Level 1, capability detection: `auto`
is CUDA where a GPU is present, else the CPU. Level 2, the autotune dispatch table: some ops have
several correct kernels whose speed depends on the machine; a backend times them per shape (its
`prepare`), and the winners are cached on disk per machine, in $SOMA_CACHE_DIR (default
~/.cache/soma-runtime)/autotune.json, where kernels ask `choice`.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from soma_runtime.backends import BACKENDS, Backend, detect_all, get, gpu_available
from soma_runtime.errors import RequestError

HOST_TASKS = ("encode",)        # tasks whose models run on the CPU whatever the machine has

_lock = threading.Lock()
_table: dict | None = None


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


def backend_for(task: str, chosen: str) -> Backend:
    """The Backend a model of `task` runs on, given the machine's choice (from `check_backend`)."""
    return get("cpu" if task in HOST_TASKS and chosen == "cuda" else chosen)


# --- the dispatch table ------------------------------------------------------------------------------

def cache_path() -> Path:
    root = os.environ.get("SOMA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "soma-runtime")
    return Path(root) / "autotune.json"


def machine_key() -> str:
    """Choices hold for one CPU model at one thread count."""
    import llvmlite.binding
    import numba
    return f"{llvmlite.binding.get_host_cpu_name()}/{numba.get_num_threads()}t"


def _load() -> dict:
    global _table
    if _table is None:
        try:
            _table = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _table = {}
    return _table


def choice(key: str) -> str | None:
    """The variant tuned for `key` on this machine, or None when it was never tuned."""
    return _load().get(machine_key(), {}).get(key)


def record(choices: dict[str, str]) -> None:
    with _lock:
        table = _load()
        table.setdefault(machine_key(), {}).update(choices)
        path = cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)                            # atomic: a concurrent reader sees old or new


def fastest(variants: dict[str, Callable[[], object]], repeats: int = 3) -> tuple[str, dict[str, float]]:
    """The variant with the lowest best-of-`repeats` time (after one warm-up call each), and all times."""
    times = {}
    for name, run in variants.items():
        run()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        times[name] = best
    return min(times, key=times.get), times


def threads() -> int | None:
    """The CPU's thread count as set (None: its default)."""
    return get("cpu").threads

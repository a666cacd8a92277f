"""The CPU's autotune dispatch table (SPEC "scheduling", level 2): some ops have several correct kernels
whose speed depends on the machine; `prepare` times them per shape, and the winners are cached on disk
per machine, in $SOMA_CACHE_DIR (default ~/.cache/soma-runtime)/autotune.json, where kernels ask `choice`.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import llvmlite.binding
import numba

from soma_runtime.backends.cpu.common import cache_root

_lock = threading.Lock()
_table: dict | None = None


def cache_path() -> Path:
    return cache_root() / "autotune.json"


def machine_key() -> str:
    """Choices hold for one CPU model at one thread count."""
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

"""Kernel-variant choices measured on this machine, cached on disk (the autotune table).

Some ops have several correct CPU kernels whose speed depends on the CPU: a many-row matmul of q8
activations by 32-block weights runs as integer block dots (VNNI where present) or as f32 BLAS on
dequantized tiles. `tune` times the variants for each weight shape of a model, once per machine
and thread count, and stores the winner; kernels ask `choice` and fall back to their default.
The table lives in $SOMA_CACHE_DIR (default ~/.cache/soma-runtime)/autotune.json.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

PREFILL_ROWS = 128           # the activation rows a prefill variant is timed with

_lock = threading.Lock()
_table: dict | None = None


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


def tune(weights, force: bool = False) -> dict[str, dict]:
    """Time the kernel variants for every distinct weight shape in `weights` (name -> tensor) that the
    table does not cover yet (all of them when `force`); record the winners. Returns
    {key: {"choice": name, "seconds": {variant: best time}}} for what was measured."""
    from soma_runtime.backends.cpu import qmatmul
    measured = {}
    for w in weights:
        key = qmatmul.prefill_key(w)
        if key is None or key in measured or (not force and choice(key) is not None):
            continue
        best, times = fastest(qmatmul.prefill_variants(w, PREFILL_ROWS))
        measured[key] = {"choice": best, "seconds": times}
    if measured:
        record({k: v["choice"] for k, v in measured.items()})
    return measured

"""The CPU backend: numpy jets (BLAS for float matmul) and numba kernels for stored-format weights.

Importing the package registers every jet; nothing else is public.
"""
from __future__ import annotations

import os

from soma_runtime.backends.cpu import attention, conv, elementwise, layout, linear  # noqa: F401  (registers jets)

NAME = "cpu"


def cpu_features() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "neon", "asimd")
    return [f for f in wanted if f in flags]


def physical_cores() -> int:
    """Distinct (socket, core) pairs this process may run on; the logical count where unknown."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores, cpu, socket = set(), None, "0"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    socket = value
                elif key == "core id" and cpu in allowed:
                    cores.add((socket, value))
    except OSError:
        pass
    return len(cores) or len(allowed)


def detect() -> dict:
    import numba
    import numpy as np
    blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {}).get("name", "?")
    return {"available": True, "cores": os.cpu_count(), "physical_cores": physical_cores(), "features": cpu_features(),
            "numba": numba.__version__, "numba_threads": numba.get_num_threads(), "blas": blas}

"""The CPU backend: numpy jets (BLAS for float matmul) and numba kernels for stored-format weights.

Importing the package registers every jet; `BACKEND` is its one public surface.
"""
from __future__ import annotations

import ctypes
import os
import sys

import numba

from soma_runtime.backends.cpu import (  # noqa: F401  (registers jets)
    adapter,
    amx,
    attention,
    autotune,
    collective,
    conv,
    detection,
    elementwise,
    experts,
    generated,
    layout,
    linear,
    primitive,
    qmatmul,
)
from soma_runtime.ir.backend import Backend, Precision


def prefer_tbb() -> None:
    """numba's TBB threading layer where the tbb wheel is installed: a parallel kernel launched from any
    thread (a server's scheduler thread) then runs as fast as from the main one, where OpenMP's team ran
    it 2.4x slower. The wheel puts libtbb in the environment's lib/, which the loader does not search: it
    is loaded here by path, so numba's load by name finds it. NUMBA_THREADING_LAYER still decides."""
    if "NUMBA_THREADING_LAYER" in os.environ:
        return
    try:
        ctypes.CDLL(os.path.join(sys.prefix, "lib", "libtbb.so.12"))
    except OSError:
        return
    numba.config.THREADING_LAYER = "tbb"


prefer_tbb()


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


class CpuBackend(Backend):
    name = "cpu"
    formulas = True
    compiles = True            # numba's kernels (cached on disk: loaded, not compiled, after the first time)

    threads: int | None = None

    def use_threads(self, threads: int | None) -> None:
        """Compute on `threads` threads (default: the physical cores: SMT siblings share a core's SIMD units)."""
        self.threads = max(1, min(threads or physical_cores(), numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(self.threads)

    def enter_thread(self) -> None:
        """numba's thread count is the calling thread's own: a new thread starts at every core."""
        if self.threads is not None:
            numba.set_num_threads(self.threads)

    def detect(self) -> dict:
        import numpy as np
        blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {}).get("name", "?")
        return {"available": True, "cores": os.cpu_count(), "physical_cores": physical_cores(), "features": cpu_features(),
                "numba": numba.__version__, "numba_threads": numba.get_num_threads(), "blas": blas,
                "autotune_key": autotune.machine_key(), "autotune_table": str(autotune.cache_path())}

    def defaults(self, task: str, fmt: str, stored: str) -> Precision:
        """As the base says, but encoders round their matmul inputs to bf16 where the CPU has matrix units
        (AMX): embeddings within 1e-4 cosine of f32, several times faster."""
        base = super().defaults(task, fmt, stored)
        if task == "encode" and amx.available():
            return Precision(base.kv_dtype, "bf16")
        return base

    def generated(self, atoms, dtypes: tuple[str, ...], out_dtype: str):
        return generated.generate(atoms, dtypes, out_dtype)

    def prepare(self, weights: list, precision: Precision, tune: bool, force: bool = False) -> dict:
        """Times the prefill variants of q8-activation matmuls (for weight shapes this machine has not seen)."""
        return qmatmul.tune(weights, force) if tune and precision.activations == "q8" else {}


BACKEND = CpuBackend()

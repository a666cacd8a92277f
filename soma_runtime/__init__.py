"""soma-runtime: one runtime for any model format on any hardware.

Layers (arrows point down only): runtime (loaders, architectures, engine, tasks) -> ir (graph, ops,
atoms, jets, plans) -> backends (reference atoms, cpu numpy/numba).
"""
import os

# OpenBLAS workers spin for ~0.1 s after each call, stealing the cores numba's kernels run on next: the
# CPU backend runs numpy's OpenBLAS on one thread (backends/cpu/blas.py); another BLAS loaded beside it
# (scipy's) spins briefly. Only takes effect when set before numpy loads.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"

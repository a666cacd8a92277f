"""The process's memory: resident pages of tensors that are views into mmapped model files, the heap
(the collector settled, freed blocks given back to the OS), and the peak resident size.

Weights are used in place, so a page of the file becomes resident only when a kernel reads it. A
tensor that has been copied (weights stacked for one matmul) gives its pages back here, so the copy
replaces the original in resident memory instead of adding to it.
"""
from __future__ import annotations

import gc
import mmap
import resource
import sys

import numpy as np


def _mapping_of(array: np.ndarray):
    """(mmap object, address of its first byte) for a view of an np.memmap, else None."""
    base = array
    while isinstance(base, np.ndarray) and not isinstance(base.base, mmap.mmap):
        base = base.base                                        # views of a memmap are memmaps too: find the root
    if not isinstance(base, np.memmap):
        return None
    lead = base.offset % mmap.ALLOCATIONGRANULARITY          # np.memmap maps from an aligned start
    return base.base, base.ctypes.data - lead


def release(array: np.ndarray) -> int:
    """Drop the resident file pages that lie wholly inside `array` (a later read maps them again).
    Returns the bytes released; arrays that are not mmapped views are left alone."""
    found = _mapping_of(array)
    if found is None or array.nbytes == 0:
        return 0
    mm, start_address = found
    begin = array.ctypes.data - start_address
    first = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (begin + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return 0
    mm.madvise(mmap.MADV_DONTNEED, first, last - first)
    return last - first


def peak_rss_mb() -> float:
    """The process's own peak resident memory so far, in MiB (Linux's VmHWM: getrusage's ru_maxrss also counts
    the peak of the parent it was forked from, across exec)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20 if sys.platform == "darwin" else 1024)


def settle_heap() -> None:
    """Collect what is garbage now, then move every object still alive out of the collector's sight
    (gc.freeze): a server's models live as long as they are served, and a full collection that scanned them
    held the GIL for ~150 ms in the middle of a request (a voice's graphs and plans). Called when a model
    has been loaded or let go; cycles a request leaves are still collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def give_back_freed() -> bool:
    """Return memory freed since the last call to the OS: glibc keeps freed blocks of every thread's
    heap resident (a model loaded on one worker thread and dropped on another leaves its copies there).
    False where the C library has no malloc_trim."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


MMAP_THRESHOLD = 4 << 20        # blocks this large and larger are mapped apart, and unmapped when freed
M_MMAP_THRESHOLD = -3           # glibc's mallopt parameter


def map_large_blocks() -> bool:
    """Have glibc map every block of MMAP_THRESHOLD bytes or more on its own, so freeing it gives it back:
    by default glibc raises its threshold as large blocks are freed and keeps what a request held (a
    server's RSS stayed +109 MB after one large speech request; +14 MB with this). False off glibc."""
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) if mallopt is not None else False


def _libc():
    import ctypes
    return ctypes.CDLL(None)

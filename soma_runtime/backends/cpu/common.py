"""Shared plumbing for CPU jets: f32 compute for half inputs, writing into a planned buffer, and where
what the CPU backend works out once per machine is kept."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from soma_runtime.dtypes import FLOATS, INTEGERS, REALS, QTensor, dtype, dtype_of

CPU = "cpu"
HALF = ("f16", "bf16")
# dtype pattern entries for jet registration
F = FLOATS               # any float dtype a model computes in
REAL = REALS             # those and f64
INT = ("i32", "i64")     # indices


def cache_root() -> Path:
    """$SOMA_CACHE_DIR, default ~/.cache/soma-runtime: the autotune table, generated jets."""
    return Path(os.environ.get("SOMA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "soma-runtime"))
INTEGER = INTEGERS       # any integer
NUMBER = (REAL, INTEGER)  # jet patterns for ops on any number: floats, and integers (their formula may differ)
ANY = "*"
ROPE_INPUTS = ((INT, "f32"), ("none", "none"))      # an op's fused rope: positions and inv_freq, or neither


def f32(x):
    """Half inputs compute in f32 (numpy's f16 arithmetic is slow and rounds every step)."""
    if x is None or isinstance(x, QTensor) or x.dtype.kind in "biu" or x.dtype in (np.float32, np.float64):
        return x
    return x.astype(np.float32)


def deliver(y: np.ndarray, like: str, out=None):
    """Return y in dtype `like`, written into `out` when the plan gave one."""
    if out is not None:
        if y is not out:                     # a kernel that wrote into `out` already needs no copy
            out[...] = y
        return out
    if like == "f32" and y.dtype == np.float32:
        return y
    return y.astype(dtype(like).numpy, copy=False)


def float_kernel(fn):
    """Wrap a kernel written for f32 arrays: upcast half inputs, return the first input's dtype.
    (Overflow to inf is the float semantics we want; the caller silences numpy's warnings once.)"""
    @functools.wraps(fn)
    def run(*inputs, out=None, **attrs):
        like = next(dtype_of(x) for x in inputs if x is not None and not isinstance(x, QTensor))
        return deliver(fn(*[f32(x) for x in inputs], **attrs), like, out)
    return run


def all_f32(*arrays) -> bool:
    """Inputs a numba fast path takes (through `dense`): f32 numpy arrays."""
    return all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in arrays)


def dense(x: np.ndarray) -> np.ndarray:
    """C order for a numba kernel. Strided views (the parts of a split) are copied rather than sent
    down another path: a row's result must not depend on which rows came with it (batching)."""
    return np.ascontiguousarray(x)


def out_f32(out, shape) -> np.ndarray:
    """The planned output buffer when it is a C-ordered f32 array of `shape`, else a new one."""
    if out is not None and out.dtype == np.float32 and out.shape == tuple(shape) and out.flags.c_contiguous:
        return out
    return np.empty(shape, np.float32)


def padded(x: np.ndarray, pads, value, out=None) -> np.ndarray:
    """x with (before, after) `pads` of `value` on its last len(pads) axes (x itself where all are zero),
    written into `out` where it fits (np.pad's own machinery costs more than the copy)."""
    pads = ((0, 0),) * (x.ndim - len(pads)) + tuple(tuple(p) for p in pads)
    if not any(a or b for a, b in pads):
        return x
    shape = tuple(n + a + b for n, (a, b) in zip(x.shape, pads))
    y = out if out is not None and out.shape == shape and out.dtype == x.dtype else np.empty(shape, x.dtype)
    y.fill(value)
    y[tuple(slice(a, a + n) for n, (a, _) in zip(x.shape, pads))] = x
    return y

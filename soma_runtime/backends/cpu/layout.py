"""CPU jets for layout and indexing ops: views where numpy gives them, copies only where needed."""
from __future__ import annotations

import numpy as np

from soma_runtime.backends.cpu.common import ANY, CPU, INT, NUMBER, F, deliver
from soma_runtime.dtypes import DTYPES, descending, dtype_of
from soma_runtime.ir.jets import jet
from soma_runtime.ir.sampling import choose


@jet("reshape", CPU, [(ANY,)])
def reshape(x, out=None, shape=()):
    return x.reshape(shape)


@jet("permute", CPU, [(ANY,)])
def permute(x, out=None, perm=()):
    return np.transpose(x, perm)


@jet("transpose", CPU, [(ANY,)])
def transpose(x, out=None, dim0=-2, dim1=-1):
    return np.swapaxes(x, dim0, dim1)


@jet("slice", CPU, [(ANY,)])
def slice_(x, out=None, axis=0, start=0, stop=None, step=1):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop, step)
    return x[tuple(index)]


@jet("concat", CPU, [(ANY,)])
def concat(*xs, out=None, axis=0):
    return np.concatenate(xs, axis=axis, out=out)


@jet("split", CPU, [(ANY,)])
def split(x, out=None, sizes=(), axis=0):
    index, start, parts = [slice(None)] * x.ndim, 0, []
    for n in sizes:                  # plain slicing: views, and a fraction of np.split's overhead
        index[axis % x.ndim] = slice(start, start + n)
        parts.append(x[tuple(index)])
        start += n
    return tuple(parts)


@jet("gather", CPU, [(ANY, INT)])
def gather(x, index, out=None, axis=0):
    return deliver(np.take_along_axis(x, index, axis=axis), dtype_of(x), out)


@jet("cast", CPU, [(ANY,)])
def cast(x, out=None, dtype="f32"):
    return deliver(x.astype(DTYPES[dtype].numpy), dtype, out)


@jet("argmax", CPU, [(F,)])
def argmax(x, out=None, axis=-1):
    return np.argmax(x, axis=axis)


@jet("topk", CPU, [(t,) for t in NUMBER])
def topk(x, out=None, k=1, axis=-1):
    """The k largest, largest first; equal values keep the lower index (like the atoms)."""
    moved = np.moveaxis(x, axis, -1)
    n = moved.shape[-1]
    key = descending(moved)
    candidates = np.argpartition(key, k - 1, axis=-1)[..., :k] if k < n else np.broadcast_to(np.arange(n), moved.shape)
    # ties at the cut may have been dropped by argpartition: fall back to a stable sort for those rows
    order = np.lexsort((candidates, np.take_along_axis(key, candidates, axis=-1)), axis=-1)
    index = np.take_along_axis(candidates, order, axis=-1)
    kth = np.take_along_axis(moved, index[..., -1:], axis=-1)
    if k < n and np.any((moved == kth).sum(-1) > (np.take_along_axis(moved, index, -1) == kth).sum(-1)):
        index = np.argsort(key, axis=-1, kind="stable")[..., :k]
    index = np.moveaxis(index, -1, axis)
    return np.take_along_axis(x, index, axis=axis), index.astype(np.int64)


@jet("sample", CPU, [(F, "f32")])
def sample(logits, params, out=None, width=64):
    """Greedy rows (temperature 0) by one argmax; the others by the host sampler's own `choose`, their
    top-k read as the op reads it."""
    rows = params.astype(np.float64)
    rows[:, 1] = np.where((rows[:, 1] >= 1) & (rows[:, 1] <= width), rows[:, 1], width)
    chosen = np.argmax(logits, axis=-1).astype(np.int64)
    for r in np.flatnonzero(rows[:, 0] != 0):
        chosen[r] = choose(logits[r], rows[r])
    return chosen

"""IR ops evaluated at import on tensors already known (initializers, Constants, shapes): numpy, with
the IR ops' attributes and ONNX's integer semantics (division truncates toward zero). The float ops
here are those exporters write into size arithmetic (floor(height * scale), as torch's interpolate does).

An object array holds symbolic dims (`Sym`): arithmetic on them stays symbolic; a comparison that only
the bound size could decide (is `batch` equal to 1?) raises SymbolicError rather than guess.
"""
from __future__ import annotations

import numpy as np

from soma_runtime.dtypes import dtype, truncated_quotient
from soma_runtime.ir.graph import Sym, dim_max, dim_min


class SymbolicError(Exception):
    """A value that depends on a symbolic dim is needed where only a number will do."""


def symbolic(x: np.ndarray) -> bool:
    return x.dtype == object


def settle(x) -> np.ndarray:
    """An object array whose entries all became numbers is an i64 array again."""
    x = np.asarray(x)
    if symbolic(x) and not any(isinstance(v, Sym) for v in x.flat):
        return x.astype(np.int64)
    return x


def divide(a, b):
    if symbolic(a) or symbolic(b):
        if np.any([isinstance(v, Sym) or v <= 0 for v in np.asarray(b).flat]):
            raise SymbolicError("division by a symbolic or negative size")
        return np.floor_divide(a, b)
    if a.dtype.kind in "iub":
        return truncated_quotient(a, b).astype(a.dtype)
    return np.divide(a, b).astype(a.dtype)


def compare(fn):
    """A comparison; with symbolic dims only where their being positive sizes settles it."""
    def run(a, b):
        if not (symbolic(a) or symbolic(b)):
            return fn(a, b)
        return np.vectorize(lambda x, y: decide(fn, x, y), otypes=[bool])(a, b)
    return run


def decide(fn, x, y):
    if not isinstance(x, Sym) and not isinstance(y, Sym):
        return bool(fn(x, y))
    if isinstance(x, Sym) and isinstance(y, Sym):
        if x == y:
            return bool(fn(0, 0))
        raise SymbolicError(f"cannot compare sizes {x} and {y} before they are bound")
    sym_first = isinstance(x, Sym)
    number = y if sym_first else x
    if number <= 0:                        # a size is at least 1
        return bool(fn(1, 0)) if sym_first else bool(fn(0, 1))
    raise SymbolicError(f"cannot compare size {x if sym_first else y} with {number} before it is bound")


def cast(x, dtype_name):
    if symbolic(x):
        if dtype_name in ("i32", "i64"):
            return x
        raise SymbolicError(f"symbolic sizes cast to {dtype_name}")
    return x.astype(dtype(dtype_name).numpy)


def slice_(x, axis, start, stop, step):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop, step)
    return x[tuple(index)]


def reduce(fn):
    def run(x, axes=(-1,), keepdims=False):
        return np.asarray(fn(x, axis=None if axes is None else tuple(axes), keepdims=keepdims)).astype(x.dtype)
    return run


SYMBOLIC_MIN, SYMBOLIC_MAX = np.frompyfunc(dim_min, 2, 1), np.frompyfunc(dim_max, 2, 1)


def extremum(numeric, symbolic_fn):
    """np.minimum or np.maximum, over sizes some of which are symbolic too."""
    return lambda a, b: symbolic_fn(a, b) if symbolic(a) or symbolic(b) else numeric(a, b)


def reduce_extremum(numeric, symbolic_fn):
    """A min or max reduction, over sizes some of which are symbolic too (one axis at a time)."""
    numeric = reduce(numeric)

    def run(x, axes=(-1,), keepdims=False):
        if not symbolic(x):
            return numeric(x, axes, keepdims)
        for axis in sorted((a % x.ndim for a in (range(x.ndim) if axes is None else axes)), reverse=True):
            x = symbolic_fn.reduce(x, axis=axis, keepdims=keepdims)
        return np.asarray(x, dtype=object)
    return run


def expand(x, shape=()):
    return np.array(np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(shape))))


def split(x, sizes=(), axis=0):
    return tuple(np.split(x, np.cumsum(sizes)[:-1], axis=axis))


def scatter(x, index, updates, axis=0):
    """x with its slices at `index` along `axis` replaced (tf2onnx edits a shape so: ScatterND)."""
    result = np.array(x, dtype=object if symbolic(updates) else x.dtype, copy=True)
    where = [slice(None)] * x.ndim
    where[axis] = index
    result[tuple(where)] = updates
    return result


def arange(start, limit, delta):
    return np.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


RAW = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": divide,
    "mod": lambda a, b, fmod: (np.fmod if fmod else np.mod)(a, b),
    "maximum": extremum(np.maximum, SYMBOLIC_MAX), "minimum": extremum(np.minimum, SYMBOLIC_MIN),
    "neg": np.negative, "abs": np.abs,
    "floor": np.floor, "ceil": np.ceil, "round": np.round, "sqrt": np.sqrt, "reciprocal": np.reciprocal,
    "equal": compare(np.equal), "less": compare(np.less), "less_equal": compare(np.less_equal),
    "greater": compare(np.greater), "greater_equal": compare(np.greater_equal),
    "logical_and": np.logical_and, "logical_or": np.logical_or, "logical_not": np.logical_not,
    "where": np.where, "cast": lambda x, dtype: cast(x, dtype),
    "concat": lambda *xs, axis: np.concatenate(xs, axis=axis),
    "take": lambda x, index, axis: np.take(x, index, axis=axis),
    "gather": lambda x, index, axis: np.take_along_axis(x, index, axis=axis),
    "slice": slice_, "split": split, "scatter": scatter,
    "reshape": lambda x, shape: np.reshape(x, tuple(shape)),
    "permute": lambda x, perm: np.transpose(x, perm),
    "expand": expand, "tile": lambda x, repeats: np.tile(x, repeats), "range": arange,
    "nonzero": lambda x: np.array(np.nonzero(x), np.int64).reshape(x.ndim, -1),
    "reduce_sum": reduce(np.sum), "reduce_prod": reduce(np.prod), "reduce_max": reduce_extremum(np.max, SYMBOLIC_MAX),
    "reduce_min": reduce_extremum(np.min, SYMBOLIC_MIN),
}


def settled(fn):
    def run(*inputs, **attrs):
        result = fn(*inputs, **attrs)
        return tuple(settle(r) for r in result) if isinstance(result, tuple) else settle(result)
    return run


FOLD = {name: settled(fn) for name, fn in RAW.items()}

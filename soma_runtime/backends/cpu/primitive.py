"""CPU jets for the primitive ops: numpy over whole tensors (floats computed in f32, stored in the
input's dtype), comparisons and logic on any numbers, reductions over several axes, and the index ops."""
from __future__ import annotations

import numpy as np

from soma_runtime.backends.cpu.common import CPU, INT, INTEGER, NUMBER, REAL, deliver, float_kernel, padded
from soma_runtime.backends.cpu.elementwise import binary_jet, erf
from soma_runtime.dtypes import dtype_of, highest, lowest
from soma_runtime.ir.jets import jet

UNARY = {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "reciprocal": lambda x: 1 / x,
         "erf": erf, "sin": np.sin, "cos": np.cos, "floor": np.floor, "ceil": np.ceil, "round": np.round,
         "neg": np.negative, "abs": np.abs, "atan": np.arctan}
for _name, _fn in UNARY.items():
    jet(_name, CPU, [(REAL,)] + ([(INTEGER,)] if _name in ("neg", "abs") else []))(float_kernel(_fn))
for _name, _fn in {"pow": np.power, "minimum": np.minimum, "maximum": np.maximum}.items():
    jet(_name, CPU, [(REAL, REAL), (INTEGER, INTEGER)])(binary_jet(_fn))

COMPARE = {"less": np.less, "less_equal": np.less_equal, "greater": np.greater, "greater_equal": np.greater_equal,
           "equal": np.equal}
for _name, _fn in COMPARE.items():
    jet(_name, CPU, [(REAL, REAL), (INTEGER, INTEGER)])(lambda a, b, out=None, fn=_fn: deliver(fn(a, b), "bool", out))
for _name, _fn in {"logical_and": np.logical_and, "logical_or": np.logical_or}.items():
    jet(_name, CPU, [("bool", "bool")])(lambda a, b, out=None, fn=_fn: deliver(fn(a, b), "bool", out))


@jet("logical_not", CPU, [("bool",)])
def logical_not(x, out=None):
    return deliver(np.logical_not(x), "bool", out)


@jet("clip", CPU, [(t,) for t in NUMBER])
@float_kernel
def clip(x, min=None, max=None):
    return np.clip(x, min, max)


REDUCE = {"reduce_sum": np.sum, "reduce_mean": np.mean, "reduce_prod": np.prod,
          "reduce_max": lambda x, **kw: np.max(x, initial=lowest(x.dtype), **kw),
          "reduce_min": lambda x, **kw: np.min(x, initial=highest(x.dtype), **kw)}
for _name, _fn in REDUCE.items():
    jet(_name, CPU, [(t,) for t in NUMBER])(float_kernel(lambda x, axes=(-1,), keepdims=False, fn=_fn:
                                         fn(x, axis=None if axes is None else tuple(axes), keepdims=keepdims)))


@jet("take", CPU, [("*", INT)])
def take(x, index, out=None, axis=0):
    return deliver(np.take(x, index, axis=axis), dtype_of(x), out)


@jet("scatter", CPU, [("*", INT, "*")])
def scatter(x, index, updates, out=None, axis=0):
    result = np.array(x, copy=True)
    where = [slice(None)] * x.ndim
    where[axis] = index
    result[tuple(where)] = updates
    return deliver(result, dtype_of(x), out)


REDUCE_AT = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


@jet("scatter_reduce", CPU, [("*", INT, "*")])
def scatter_reduce(x, index, updates, out=None, axis=0, reduction="add"):
    result = np.array(x, copy=True)
    where = [slice(None)] * x.ndim
    where[axis] = np.where(index < 0, index + x.shape[axis], index)
    REDUCE_AT[reduction].at(result, tuple(where), updates)
    return deliver(result, dtype_of(x), out)


@jet("expand", CPU, [("*",)])
def expand(x, out=None, shape=()):
    return np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(shape)))


@jet("pad", CPU, [("*",)])
def pad(x, out=None, pads=(), mode="constant", value=0.0):
    if mode == "constant":                               # negative pads crop
        x = x[tuple(slice(max(0, -a), x.shape[i] - max(0, -b)) for i, (a, b) in enumerate(pads))]
        return deliver(padded(x, [(max(0, a), max(0, b)) for a, b in pads], value, out), dtype_of(x), out)
    for axis, (before, after) in enumerate(pads):        # each padded axis read at folded indices (np.pad's
        if before or after:                              # own machinery costs a streaming model's whole step)
            n = x.shape[axis]
            index = np.arange(-before, n + after)
            if mode == "edge":
                index = np.clip(index, 0, n - 1)
            else:
                index = n - 1 - np.abs(n - 1 - np.abs(index))
            x = np.take(x, index, axis=axis)
    return deliver(x, dtype_of(x), out)


for _name, _fn in {"cumsum": np.cumsum, "cumprod": np.cumprod}.items():
    jet(_name, CPU, [(t,) for t in NUMBER])(float_kernel(lambda x, axis=-1, fn=_fn: fn(x, axis=axis)))


@jet("tile", CPU, [("*",)])
def tile(x, out=None, repeats=()):
    return deliver(np.tile(x, tuple(repeats)), dtype_of(x), out)


@jet("range", CPU, [(dt, dt, dt) for dt in ("i64", "i32", "f32")])
def range_(start, limit, delta, out=None):
    """ONNX's Range: ceil((limit - start) / delta) values, in the inputs' dtype."""
    start, limit, delta = (np.asarray(v).reshape(-1)[0] for v in (start, limit, delta))   # 0-d, or 1 from a device
    count = max(0, int(np.ceil((float(limit) - float(start)) / float(delta))))
    return (start + np.arange(count) * delta).astype(start.dtype)


@jet("nonzero", CPU, [("*",)])
def nonzero(x, out=None):
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)

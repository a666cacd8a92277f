"""Primitive ops: one per atom mode the op set otherwise lacks, so any graph (an ONNX one) can be
written in ops, and the fuse pass can recognize what they compose. Elementwise functions,
comparisons and logic, reductions over several axes, and the index ops built from reads: expand,
pad, cumsum, tile, and `range` and `nonzero`, whose lengths only their inputs' values decide.
"""
from __future__ import annotations

import math

import numpy as np

from soma_runtime.ir.atoms import Ref
from soma_runtime.ir.graph import DYNAMIC, TensorMeta, same_dim
from soma_runtime.ir.ops.base import (
    arithmetic,
    broadcast_shapes,
    check,
    like_number,
    like_real,
    number_dtype,
    op,
    same_dtype,
    truncated_division,
)

INTS = ("i32", "i64")


def unary(name: str, build, rule=like_real):
    """An elementwise function of one float input (of any number with `like_number`)."""
    op(name, ["x"], rule)(lambda A, x: build(A, x))


unary("exp", lambda A, x: A.exp("exp", x))
unary("log", lambda A, x: A.exp("log", x))
unary("sqrt", lambda A, x: A.exp("sqrt", x))
unary("rsqrt", lambda A, x: A.exp("rsqrt", x))
unary("reciprocal", lambda A, x: A.exp("recip", x))
unary("erf", lambda A, x: A.exp("erf", x))
unary("sin", lambda A, x: A.exp("sin", x))
unary("cos", lambda A, x: A.exp("cos", x))
unary("floor", lambda A, x: A.exp("floor", x))
unary("ceil", lambda A, x: A.mul(A.exp("floor", A.mul(x, A.lit(-1))), A.lit(-1)))
unary("round", lambda A, x: A.exp("round", x))                 # half to even, as numpy, torch and ONNX
unary("neg", lambda A, x: A.mul(x, A.lit(-1)), like_number)


def atan_atoms(A, x):
    """atan: |x| folded into [0, 1] (atan t = pi/2 - atan 1/t), a first guess within 2e-3 refined by three
    Newton steps on tan y = t (y -= cos y (sin y - t cos y): each squares the error), the sign put back."""
    size = A.cmp("max", x, A.mul(x, A.lit(-1)))
    inverted = A.cmp("lt", A.lit(1), size)
    t = A.cmp("select", inverted, A.exp("recip", size), size)
    y = A.add(A.mul(t, A.lit(math.pi / 4)), A.mul(A.mul(t, A.sub(A.lit(1), t)), A.lit(0.273)))
    for _ in range(3):
        cos = A.exp("cos", y)
        y = A.sub(y, A.mul(cos, A.sub(A.exp("sin", y), A.mul(t, cos))))
    y = A.cmp("select", inverted, A.sub(A.lit(math.pi / 2), y), y)
    return A.cmp("select", A.cmp("lt", x, A.lit(0)), A.mul(y, A.lit(-1)), y)


unary("atan", atan_atoms)
unary("abs", lambda A, x: A.cmp("max", x, A.mul(x, A.lit(-1))), like_number)


@op("pow", ["a", "b"], arithmetic)
def pow_(A, a, b): return A.exp("pow", a, b)


@op("minimum", ["a", "b"], arithmetic)
def minimum(A, a, b): return A.cmp("min", a, b)


@op("maximum", ["a", "b"], arithmetic)
def maximum(A, a, b): return A.cmp("max", a, b)


@op("clip", ["x"], like_number, attrs={"min": None, "max": None})
def clip(A, x, min, max):
    """x within [min, max]; an absent bound is an infinite one."""
    low = A.param(-math.inf if min is None else min)
    return A.cmp("min", A.cmp("max", x, low), A.param(math.inf if max is None else max))


def compare_rule(metas, attrs):
    same_dtype(*metas)
    check(metas[0].dtype != "bool", "comparisons take numbers, not bool")
    return [TensorMeta(broadcast_shapes(*[m.shape for m in metas]), "bool")]


def comparison(name: str, mode: str, swapped: bool = False):
    """a < b and its kin; greater-than is less-than with the operands swapped."""
    op(name, ["a", "b"], compare_rule)(lambda A, a, b: A.cmp(mode, b, a) if swapped else A.cmp(mode, a, b))


comparison("less", "lt")
comparison("less_equal", "le")
comparison("greater", "lt", swapped=True)
comparison("greater_equal", "le", swapped=True)
comparison("equal", "eq")


def logic_rule(metas, attrs):
    check(all(m.dtype == "bool" for m in metas), f"logical ops take bool, got {', '.join(m.dtype for m in metas)}")
    return [TensorMeta(broadcast_shapes(*[m.shape for m in metas]), "bool")]


@op("logical_and", ["a", "b"], logic_rule)
def logical_and(A, a, b): return A.mul(a, b)


@op("logical_or", ["a", "b"], logic_rule)
def logical_or(A, a, b): return A.cmp("max", a, b)


@op("logical_not", ["x"], logic_rule)
def logical_not(A, x): return A.cmp("eq", x, A.lit(0))


def reduced_axes(rank: int, axes) -> tuple[int, ...]:
    axes = tuple(range(rank)) if axes is None else tuple(axes)
    check(all(-rank <= a < rank for a in axes), f"axes {list(axes)} out of range for rank {rank}")
    normal = tuple(sorted(a % rank for a in axes))
    check(len(set(normal)) == len(normal), f"axes {list(axes)} repeat an axis")
    return normal


def reduce_rule(metas, attrs):
    x = metas[0]
    number_dtype(x)
    axes = reduced_axes(x.ndim, attrs["axes"])
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape) if attrs["keepdims"] or i not in axes)
    return [TensorMeta(shape, x.dtype)]


def reduction(name: str, mode: str):
    """A reduction over `axes` (None: all of them), keeping them as size 1 with `keepdims`. Its formula
    names the axes from the end (-1 is the last), as the fused ops' formulas do."""
    def decompose(A, x, axes, keepdims):
        rank = len(x.shape)
        return A.reduce(mode, x, axis=tuple(a - rank for a in reduced_axes(rank, axes)), keepdims=keepdims)
    op(name, ["x"], reduce_rule, attrs={"axes": (-1,), "keepdims": False})(decompose)


reduction("reduce_sum", "sum")
reduction("reduce_mean", "mean")
reduction("reduce_max", "max")
reduction("reduce_min", "min")
reduction("reduce_prod", "prod")


def take_rule(metas, attrs):
    x, index = metas
    check(index.dtype in INTS, f"indices must be integer, got {index.dtype}")
    check(-x.ndim <= attrs["axis"] < x.ndim, f"axis {attrs['axis']} out of range for rank {x.ndim}")
    axis = attrs["axis"] % x.ndim
    return [TensorMeta(tuple(x.shape[:axis]) + tuple(index.shape) + tuple(x.shape[axis + 1:]), x.dtype)]


@op("take", ["x", "index"], take_rule, attrs={"axis": 0}, ranks=(2, 1))
def take(A, x, index, axis):
    """x's slices along `axis` at `index` (any shape; negative counts from the end), as numpy's take."""
    return A.read("take", x, index, axis=axis)


def scatter_rule(metas, attrs):
    x, index, updates = metas
    check(index.dtype in INTS and index.ndim == 1,
          f"scatter indices must be a 1-D integer tensor, got {index.dtype}{list(index.shape)}")
    axis = attrs["axis"] % x.ndim
    want = tuple(index.shape[0] if i == axis else d for i, d in enumerate(x.shape))
    fits = updates.ndim == x.ndim and all(same_dim(a, b) is not False for a, b in zip(updates.shape, want))
    check(updates.dtype == x.dtype and fits,
          f"scatter updates must be {x.dtype}{list(want)}, got {updates.dtype}{list(updates.shape)}")
    return [x]


@op("scatter", ["x", "index", "updates"], scatter_rule, attrs={"axis": 0}, ranks=(2, 1, 2))
def scatter(A, x, index, updates, axis):
    """x with its slices along `axis` at `index` replaced by those of `updates` (torch's index_copy; where
    an index repeats, the last update stays)."""
    return A.write("scatter", x, updates, index, axis=axis)


REDUCTIONS = ("add", "mul", "max", "min")


@op("scatter_reduce", ["x", "index", "updates"], scatter_rule, attrs={"axis": 0, "reduction": "add"},
    struct={"reduction": REDUCTIONS}, ranks=(2, 1, 2))
def scatter_reduce(A, x, index, updates, axis, reduction):
    """x with the slices of `updates` combined into those along `axis` at `index` by add, mul, max or min
    (every update counts where an index repeats; x's own values take part). Each of x's slices j reduces the
    updates whose index is j: a [n, m] table of hits."""
    n, m = x.shape[axis], index.shape[0]
    rank = len(x.shape)
    index = A.cmp("select", A.cmp("lt", index, A.lit(0)), A.add(index, A.param(n)), index)
    hits = A.cmp("eq", A.read("reshape", A.read("iota", n=n, axis=0, ndim=1), shape=(n, 1)),
                 A.read("reshape", index, shape=(1, m)))
    hits = A.read("reshape", hits, shape=(1,) * axis + (n, m) + (1,) * (rank - axis - 1))
    spread = A.read("expand", updates, axis=axis)                                # [..., 1, m, ...]
    identity = {"add": 0.0, "mul": 1.0, "max": -math.inf, "min": math.inf}[reduction]
    mode = {"add": "sum", "mul": "prod", "max": "max", "min": "min"}[reduction]
    combined = A.reduce(mode, A.cmp("select", hits, spread, A.lit(identity)), axis=axis + 1, keepdims=False)
    return A.add(x, combined) if reduction == "add" else A.mul(x, combined) if reduction == "mul" else \
        A.cmp(reduction, x, combined)


def expand_rule(metas, attrs):
    return [TensorMeta(broadcast_shapes(metas[0].shape, tuple(attrs["shape"])), metas[0].dtype)]


@op("expand", ["x"], expand_rule, attrs={"shape": ()})
def expand(A, x, shape):
    """x broadcast to `shape` (both ways, as ONNX's Expand: a 1 in `shape` keeps x's size)."""
    return A.read("broadcast", x, shape=broadcast_shapes(x.shape, tuple(shape)))


PAD_MODES = ("constant", "reflect", "edge")


def pad_rule(metas, attrs):
    x, pads = metas[0], attrs["pads"]
    check(len(pads) == x.ndim and all(len(p) == 2 for p in pads),
          f"pads must give (before, after) for each of {x.ndim} axes, got {list(pads)}")
    check(all(not isinstance(n + a + b, int) or n + a + b >= 0 for n, (a, b) in zip(x.shape, pads)),
          f"pads {list(pads)} crop more than the axes {list(x.shape)} hold")
    check(attrs["mode"] in PAD_MODES, f"mode must be one of {', '.join(PAD_MODES)}, got {attrs['mode']!r}")
    if attrs["mode"] == "reflect":
        check(all(not isinstance(n, int) or max(p) < n for n, p in zip(x.shape, pads)),
              "reflect pads must be shorter than their axis")
    if attrs["mode"] != "constant":
        check(all(not isinstance(n, int) or n > 0 or p == (0, 0) for n, p in zip(x.shape, pads)),
              "cannot pad an empty axis by its edge")
    return [TensorMeta(tuple(n + a + b for n, (a, b) in zip(x.shape, pads)), x.dtype)]


@op("pad", ["x"], pad_rule, attrs={"pads": (), "mode": "constant", "value": 0.0}, struct={"mode": PAD_MODES}, any_rank=True)
def pad(A, x, pads, mode, value):
    """Constant: x placed in a tensor of `value`. Reflect and edge: each axis read at indices folded
    back into it (reflect mirrors about the end values, edge repeats them), one read per axis whatever
    its pads, so the formula depends on the rank alone. A negative pad crops (as ONNX's and torch's)."""
    pads = tuple(pads) or ((0, 0),) * len(x.shape)
    if mode == "constant" and any(isinstance(p, int) and p < 0 for pair in pads for p in pair):
        shape = list(x.shape)                  # what a negative pad crops, sliced off first
        for axis, (before, after) in enumerate(pads):
            if before < 0 or after < 0:
                x = A.read("slice", x, axis=axis, start=max(0, -before), stop=shape[axis] - max(0, -after))
                shape[axis] -= max(0, -before) + max(0, -after)
        x = Ref(x.index, tuple(shape), x.dtype)
        pads = tuple((max(0, a), max(0, b)) for a, b in pads)
    if mode == "constant":
        shape = tuple(n + a + b for n, (a, b) in zip(x.shape, pads))
        out = A.read("fill", shape=shape, value=value)
        return A.write("place", out, x, axes=tuple(range(len(pads))), starts=tuple(a for a, _ in pads), steps=(1,) * len(pads))
    for axis, (n, (before, after)) in enumerate(zip(x.shape, pads)):
        index = A.sub(A.read("iota", n=n + before + after, axis=0, ndim=1), A.param(before))
        last = A.param(n - 1)
        if mode == "edge":
            index = A.cmp("min", A.cmp("max", index, A.lit(0)), last)
        else:
            index = A.cmp("max", index, A.mul(index, A.lit(-1)))                     # |i|
            folded = A.sub(last, index)
            index = A.sub(last, A.cmp("max", folded, A.mul(folded, A.lit(-1))))      # n-1 - |n-1 - |i||
        x = A.read("take", x, A.read("cast", index, struct=("i64",)), axis=axis)
    return x


def axis_rule(metas, attrs):
    x = metas[0]
    number_dtype(x)
    check(-x.ndim <= attrs["axis"] < x.ndim, f"axis {attrs['axis']} out of range for rank {x.ndim}")
    return [x]


def running(name: str, mode: str, identity: float):
    """Running sums (products) along an axis: each position's window of the n values up to it, over the
    identity before the first."""
    def decompose(A, x, axis):
        n = x.shape[axis]
        pads = [(0, 0)] * len(x.shape)
        pads[axis] = (n - 1, 0)
        padded = pad(A, x, tuple(pads), "constant", identity)
        windows = A.slide(padded, axes=(axis,), window=(n,), stride=(1,), dilation=(1,))
        return A.reduce(mode, windows, axis=-1, keepdims=False)
    op(name, ["x"], axis_rule, attrs={"axis": -1})(decompose)


running("cumsum", "sum", 0.0)
running("cumprod", "prod", 1.0)


def tile_rule(metas, attrs):
    x, repeats = metas[0], tuple(attrs["repeats"])
    check(len(repeats) == x.ndim and all(isinstance(r, int) and r >= 1 for r in repeats),
          f"repeats must give a count >= 1 for each of {x.ndim} axes, got {list(repeats)}")
    return [TensorMeta(tuple(n * r for n, r in zip(x.shape, repeats)), x.dtype)]


@op("tile", ["x"], tile_rule, attrs={"repeats": ()})
def tile(A, x, repeats):
    """np.tile: each axis of n values becomes r copies of them, one after another."""
    shape = tuple(x.shape)
    paired = tuple(d for n in shape for d in (1, n))
    copies = tuple(d for n, r in zip(shape, repeats) for d in (r, n))
    out = A.read("broadcast", A.read("reshape", x, shape=paired), shape=copies)
    return A.read("reshape", out, shape=tuple(n * r for n, r in zip(shape, repeats)))


def range_rule(metas, attrs):
    check(all(m.ndim == 0 for m in metas), "range takes scalar start, limit and delta")
    dt = same_dtype(*metas)
    check(dt in ("f32", "f64", *INTS), f"range takes numbers, got {dt}")
    return [TensorMeta((DYNAMIC,), dt)]


def range_count(start, limit, delta) -> int:
    """A range's length, computed exactly (Python numbers, no overflow); ValueError for a delta of 0 or a
    bound that is no finite number."""
    start, limit, delta = (np.asarray(v).reshape(-1)[0].item() for v in (start, limit, delta))
    if not all(math.isfinite(v) for v in (start, limit, delta)) or delta == 0:
        raise ValueError(f"a range from {start} to {limit} by {delta} has no length")
    if all(isinstance(v, int) for v in (start, limit, delta)):
        return max(0, -((start - limit) // delta))
    steps = (limit - start) / delta
    if not math.isfinite(steps):
        raise ValueError(f"a range from {start} to {limit} by {delta} has more values than any size")
    return max(0, math.ceil(steps))


@op("range", ["start", "limit", "delta"], range_rule, ranks=(0, 0, 0), count=range_count)
def range_(A, start, limit, delta):
    """start, start + delta, ... up to (not including) limit: ceil((limit - start) / delta) values, a
    length only the inputs' values decide (a dynamic dim, known once the node has run)."""
    count = A.mul(A.exp("floor", A.mul(A.mul(A.sub(limit, start), A.exp("recip", delta)), A.lit(-1))), A.lit(-1))
    steps = A.read("cast", A.read("arange", count), struct=(start.dtype,))
    return A.read("cast", A.add(start, A.mul(steps, delta)), struct=(start.dtype,))


def nonzero_rule(metas, attrs):
    x = metas[0]
    check(x.ndim >= 1, "nonzero takes a tensor of rank >= 1")
    return [TensorMeta((x.ndim, DYNAMIC), "i64")]


@op("nonzero", ["x"], nonzero_rule, any_rank=True, count=lambda x: int(np.count_nonzero(x)))
def nonzero(A, x):
    """The coordinates of x's nonzero elements, one column each in row-major order ([rank, count]; a count
    only the data decides). The flat positions are the first `count` of all positions ordered by
    nonzero-first (ties keep the lower position); each axis' coordinate is position // stride % size."""
    shape = x.shape
    n = math.prod(shape)
    hit = A.sub(A.lit(1), A.read("cast", A.cmp("eq", x, A.lit(0)), struct=("i64",)))
    flat = A.read("reshape", hit, shape=(n,))
    order = A.reduce("topk", flat, axis=0, keepdims=False, k=n)
    position = A.read("expand", A.read("take", order, A.read("arange", A.reduce("sum", flat, axis=0, keepdims=False)),
                                       axis=0), axis=0)
    axis = A.read("iota", n=len(shape), axis=0, ndim=2)
    stride, size = A.lit(0), A.lit(0)
    for d in range(len(shape)):
        here = A.cmp("eq", axis, A.param(d))
        stride = A.cmp("select", here, A.param(math.prod(shape[d + 1:])), stride)
        size = A.cmp("select", here, A.param(shape[d]), size)
    coordinate = truncated_division(A, truncated_division(A, position, stride)[0], size)[1]
    return A.read("cast", coordinate, struct=("i64",))

"""ONNX ops that shape, index and reduce: constants, Shape, Reshape and its kin, Slice, Gather, Pad,
scatters, reductions, ArgMax, TopK, NonZero, Unique. Axes must be known at load time (they become the
IR ops' attributes); a dim the model names stays symbolic, and a count only the data decides (NonZero's,
a computed TopK k) is bound when the graph runs."""
from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from soma_runtime.dtypes import dtype
from soma_runtime.ir.graph import Sym
from soma_runtime.ir.jets import MAX_VARIADIC
from soma_runtime.loaders.onnx.fold import SymbolicError
from soma_runtime.loaders.onnx.ops.elementwise import scalar
from soma_runtime.loaders.onnx.ops.table import onnx_op
from soma_runtime.loaders.onnx.reader import dtype_name, tensor_array

BIG = 1 << 62            # an end past any real size: ONNX's INT64_MAX, "to the end"
SENTINEL = 10**9         # from here on a slice bound means "to the end" (tf2onnx writes 1e9, others INT32_MAX)


def dims_array(dims) -> np.ndarray:
    """Sizes as an i64 array; an object array where one is symbolic."""
    dims = list(dims)
    return np.array(dims, dtype=object if any(isinstance(d, Sym) for d in dims) else np.int64).reshape(len(dims))


def axes_of(cv, n, rank: int, attr_until: int, index: int = 1) -> list[int] | None:
    """An op's axes (an attribute before opset `attr_until`, an input from it), made non-negative."""
    axes = n.attr("axes") if n.opset < attr_until else cv.ints(n.input(index), "axes")
    return None if axes is None else [cv.axis(a, rank) for a in axes]


@onnx_op("Constant")
def constant(cv, n):
    for key, make in (("value", lambda t: tensor_array(t, cv.directory, cv.where())), ("value_float", np.float32),
                      ("value_floats", lambda v: np.array(v, np.float32)), ("value_int", np.int64),
                      ("value_ints", lambda v: np.array(v, np.int64)), ("value_string", lambda v: np.array(v, str)),
                      ("value_strings", lambda v: np.array([s.decode() for s in v], str))):
        if key in n.attrs:
            return np.array(make(n.attrs[key]))
    raise cv.unsupported(f"a constant given as {', '.join(n.attrs) or 'nothing'} (sparse tensors are not supported)")


@onnx_op("ConstantOfShape")
def constant_of_shape(cv, n):
    value = numpy_helper.to_array(n.attrs["value"]).reshape(-1) if "value" in n.attrs else np.zeros(1, np.float32)
    if value.size != 1:
        raise cv.invalid(f"its value holds {value.size} numbers, not one")
    shape = cv.ints(n.inputs[0], "shape", symbolic=True)
    return cv.emit("expand", value.reshape([1] * len(shape)), shape=tuple(shape))


@onnx_op("Shape")
def shape(cv, n):
    dims = cv.meta(n.inputs[0]).shape
    start, end = n.attr("start", 0), n.attr("end")
    return dims_array(dims[start:end])


@onnx_op("Size")
def size(cv, n):
    total = 1
    for d in cv.meta(n.inputs[0]).shape:
        total = total * d
    return dims_array([total]).reshape(())


def reshape_to(cv, x, dims):
    return cv.emit("reshape", x, shape=tuple(dims))


@onnx_op("Reshape")
def reshape(cv, n):
    x = n.inputs[0]
    source = cv.meta(x).shape
    target = cv.ints(n.inputs[1], "shape", symbolic=True) if n.opset >= 5 else list(n.attr("shape"))
    if not n.attr("allowzero", 0):
        target = [source[i] if isinstance(d, int) and d == 0 else d for i, d in enumerate(target)]
    return reshape_to(cv, x, target)


def product(dims):
    total = 1
    for d in dims:
        total = total * d
    return total


@onnx_op("Flatten")
def flatten(cv, n):
    x = n.inputs[0]
    dims = cv.meta(x).shape
    axis = n.attr("axis", 1)
    axis = axis if axis == len(dims) else cv.axis(axis, len(dims))           # rank itself: all of x before the cut
    return reshape_to(cv, x, (product(dims[:axis]), product(dims[axis:])))


@onnx_op("Transpose")
def transpose(cv, n):
    x = n.inputs[0]
    perm = n.attr("perm") or list(reversed(range(cv.meta(x).ndim)))
    return cv.emit("permute", x, perm=tuple(int(p) for p in perm))


@onnx_op("Squeeze")
def squeeze(cv, n):
    x = n.inputs[0]
    dims = cv.meta(x).shape
    axes = axes_of(cv, n, len(dims), 13)
    if axes is None:
        if any(isinstance(d, Sym) for d in dims):            # a symbolic size may be 1: squeezed or not per shape
            raise SymbolicError(f"squeezing every axis of size 1 of {list(dims)}")
        axes = [i for i, d in enumerate(dims) if d == 1]
    for a in axes:
        if isinstance(dims[a], int) and dims[a] != 1:
            raise cv.unsupported(f"cannot squeeze axis {a} of size {dims[a]}")
    return reshape_to(cv, x, [d for i, d in enumerate(dims) if i not in axes])


@onnx_op("Unsqueeze")
def unsqueeze(cv, n):
    x = n.inputs[0]
    dims = list(cv.meta(x).shape)
    axes = axes_of(cv, n, len(dims) + len(n.attr("axes", []) if n.opset < 13 else cv.ints(n.input(1), "axes")), 13)
    for a in sorted(axes):
        dims.insert(a, 1)
    return reshape_to(cv, x, dims)


@onnx_op("Concat")
def concat(cv, n):
    xs = [x for x in n.inputs if x is not None]
    return joined(cv, xs, cv.axis(n.attr("axis", 1 if n.opset < 4 else None), cv.meta(xs[0]).ndim))


def joined(cv, xs: list, axis: int):
    """A concat of any number of tensors, as a tree of concats of at most MAX_VARIADIC each: the most a
    jet takes (more would run as atoms, slowly)."""
    while len(xs) > MAX_VARIADIC:
        xs = [x[0] if len(x) == 1 else cv.emit("concat", *x, axis=axis)
              for x in (xs[i:i + MAX_VARIADIC] for i in range(0, len(xs), MAX_VARIADIC))]
    return xs[0] if len(xs) == 1 else cv.emit("concat", *xs, axis=axis)


@onnx_op("Split")
def split(cv, n):
    x = n.inputs[0]
    dims = cv.meta(x).shape
    axis = cv.axis(n.attr("axis", 0), len(dims))
    sizes = cv.ints(n.input(1), "split sizes") if n.opset >= 13 or n.opset == 1 and n.input(1) is not None \
        else n.attr("split")                   # Split-1 took its sizes as an input or an attribute
    if not sizes:
        if not isinstance(dims[axis], int):
            raise SymbolicError(f"an even split of symbolic axis {dims[axis]}")
        parts = n.attr("num_outputs", n.n_outputs)
        step = -(-dims[axis] // parts)
        sizes = [min(step, dims[axis] - i * step) for i in range(parts)]
    out = cv.emit("split", x, sizes=tuple(int(s) for s in sizes), axis=axis)
    return out if isinstance(out, tuple) else (out,)


def slice_axis(cv, x, axis, start, end, step):
    """One axis of an ONNX Slice: its clamping, negative indices and steps of either sign."""
    size = cv.meta(x).shape[axis]
    if not isinstance(size, int) and step > 0:          # sentinels on a symbolic axis: its ends, never sizes
        start = 0 if isinstance(start, int) and start <= -SENTINEL else start
        end = BIG if isinstance(end, int) and end >= SENTINEL else end
    if (isinstance(start, Sym) or isinstance(end, Sym)) and step > 0:   # x[:, :sequence]: bound when planned
        return cv.emit("slice", x, axis=axis, start=start, stop=None if isinstance(end, int) and end >= BIG else end,
                       step=step)                                       # (Python's slices clamp as ONNX's do)
    if isinstance(start, Sym) or isinstance(end, Sym):
        raise SymbolicError(f"a reversed slice from {start} to {end}: bounds given by symbolic sizes")
    if isinstance(size, int):
        start, stop, step = slice(start, None if end >= BIG else end, step).indices(size)
        if step < 0:
            return cv.emit("take", x, np.arange(start, stop, step, dtype=np.int64), axis=axis)
        return cv.emit("slice", x, axis=axis, start=start, stop=max(stop, start), step=step)
    if step < 0:
        raise SymbolicError(f"a reversed slice of symbolic axis {size}")
    start = size + start if start < 0 else start
    stop = None if end >= BIG else (size + end if end < 0 else end)
    return cv.emit("slice", x, axis=axis, start=start, stop=stop, step=step)


@onnx_op("Slice", "DynamicSlice")
def slice_(cv, n):
    """Bounds as attributes before opset 10, as inputs after (and in DynamicSlice, onnxruntime's experimental
    Slice of opset 1)."""
    x = n.inputs[0]
    rank = cv.meta(x).ndim
    if n.opset < 10 and n.op_type == "Slice":
        starts, ends, axes, steps = n.attr("starts"), n.attr("ends"), n.attr("axes"), None
    else:
        starts, ends = cv.ints(n.inputs[1], "starts", symbolic=True), cv.ints(n.inputs[2], "ends", symbolic=True)
        axes, steps = cv.ints(n.input(3), "axes"), cv.ints(n.input(4), "steps")
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    for axis, start, end, step in zip(axes, starts, ends, steps):
        if step == 0:
            raise cv.unsupported("a slice step of 0")
        x = slice_axis(cv, x, cv.axis(axis, rank), start, end, step)
    return x


@onnx_op("Crop")
def crop(cv, n):
    """The experimental Crop of opset 1 (onnxruntime still runs it): [N, C, H, W] less `border` (left, top,
    right, bottom); with `scale` (height, width), that size from the top-left corner of the border."""
    x, border, size = n.inputs[0], n.attr("border"), n.attr("scale")
    if border is None or len(border) != 4 or cv.meta(x).ndim != 4 or size is not None and len(size) != 2:
        raise cv.invalid(f"a border of 4 ints (and a scale of 2) over [N, C, H, W] are needed, given {border}, {size}")
    left, top, right, bottom = border
    h, w = cv.meta(x).shape[2:]
    height, width = size if size is not None else (h - top - bottom, w - left - right)
    for axis, start, length in ((2, top, height), (3, left, width)):
        x = cv.emit("slice", x, axis=axis, start=start, stop=start + length, step=1)
    return x


@onnx_op("Gather")
def gather(cv, n):
    x, index = n.inputs
    return cv.emit("take", x, index, axis=cv.axis(n.attr("axis", 0), cv.meta(x).ndim))


@onnx_op("GatherElements")
def gather_elements(cv, n):
    x, index = n.inputs
    return cv.emit("gather", x, index, axis=cv.axis(n.attr("axis", 0), cv.meta(x).ndim))


@onnx_op("Expand")
def expand(cv, n):
    return cv.emit("expand", n.inputs[0], shape=tuple(cv.ints(n.inputs[1], "shape", symbolic=True)))


@onnx_op("Tile")
def tile(cv, n):
    """Tile-1 repeats along one axis (`tiles` times along `axis`, both inputs); Tile-6, along every axis."""
    x = n.inputs[0]
    if n.opset >= 6:
        return cv.emit("tile", x, repeats=tuple(cv.ints(n.inputs[1], "repeats")))
    repeats = [1] * cv.meta(x).ndim
    repeats[cv.axis(cv.ints(n.inputs[2], "axis")[0], len(repeats))] = cv.ints(n.inputs[1], "tiles")[0]
    return cv.emit("tile", x, repeats=tuple(repeats))


@onnx_op("Range")
def range_(cv, n):
    """start, start + delta, ... below limit. A limit that is a symbolic size (positions 0..sequence-1)
    becomes the running count of that many ones: its length stays the symbol, not a size the data decides."""
    start, limit, delta = n.inputs
    bounds = [x.reshape(-1)[0] if isinstance(x, np.ndarray) and x.size == 1 else None for x in (start, limit, delta)]
    if isinstance(bounds[1], Sym) and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool)
                                          for b in (bounds[0], bounds[2])) and bounds[2] > 0:
        first, step = int(bounds[0]), int(bounds[2])
        steps = cv.arange((bounds[1] - first + step - 1) // step)
        return cv.emit("add", cv.emit("mul", steps, np.array(step, np.int64)), np.array(first, np.int64))
    return cv.emit("range", *n.inputs)


@onnx_op("NonZero")
def nonzero(cv, n):
    """The coordinates of the nonzero elements, [rank, count]: a count only the data decides."""
    x = n.inputs[0]
    if cv.meta(x).ndim == 0:
        raise cv.unsupported("NonZero of a scalar")
    return cv.emit("nonzero", x)


@onnx_op("Compress")
def compress(cv, n):
    """The slices along `axis` (of the flattened input without one) where the condition is true."""
    x, condition = n.inputs
    axis = n.attr("axis")
    if axis is None:
        x, axis = reshape_to(cv, x, (product(cv.meta(x).shape),)), 0
    kept = cv.emit("take", cv.emit("nonzero", condition), np.array(0, np.int64), axis=0)
    return cv.emit("take", x, kept, axis=cv.axis(axis, cv.meta(x).ndim))


@onnx_op("Pad")
def pad(cv, n):
    x = n.inputs[0]
    rank = cv.meta(x).ndim
    mode = n.attr("mode", "constant")
    if n.opset < 11:
        pads, value, axes = n.attr("pads", n.attr("paddings")), n.attr("value", 0.0), None
    else:
        pads = cv.ints(n.inputs[1], "pads", symbolic=True)
        given = cv.known(n.input(2), "pad value", np.zeros(0))
        value = given.reshape(-1)[0].item() if given.size else 0.0
        axes = cv.ints(n.input(3), "axes")
    axes = list(range(rank)) if axes is None else [cv.axis(a, rank) for a in axes]
    half = len(pads) // 2
    widths = [(0, 0)] * rank
    for a, before, after in zip(axes, pads[:half], pads[half:]):
        widths[a] = (before, after)
    if mode == "wrap":
        return wrapped(cv, x, widths)
    if mode not in ("constant", "reflect", "edge"):
        raise cv.unsupported(f"pad mode {mode!r}")
    for a, (before, after) in enumerate(widths):          # negative pads crop (symbolic ones, when planned)
        if isinstance(before, int) and before < 0 or isinstance(after, int) and after < 0:
            size = cv.meta(x).shape[a]
            x = slice_axis(cv, x, a, max(-before, 0) if isinstance(before, int) else 0,
                           size - max(-after, 0) if isinstance(after, int) and after < 0 else BIG, 1)
            widths[a] = tuple(max(p, 0) if isinstance(p, int) else p for p in (before, after))
    widths = tuple(widths)
    if not any(isinstance(p, Sym) or p for pair in widths for p in pair):
        return x
    return cv.emit("pad", x, pads=widths, mode=mode, value=float(value))


def wrapped(cv, x, widths):
    """Wrap padding: each axis read at its positions less the pad before, modulo its length."""
    for a, (before, after) in enumerate(widths):
        size = cv.meta(x).shape[a]
        if not all(isinstance(v, int) for v in (size, before, after)):
            raise SymbolicError("wrap padding of symbolic sizes")
        if before or after:
            x = cv.emit("take", x, np.arange(-before, size + after, dtype=np.int64) % size, axis=a)
    return x


@onnx_op("ReverseSequence")
def reverse_sequence(cv, n):
    """Each batch entry's first `length` steps reversed (the rest kept): a gather along the time axis at
    length - 1 - t where t < length."""
    x, lengths = n.inputs
    dims = cv.meta(x).shape
    time_axis, batch_axis = int(n.attr("time_axis", 0)), int(n.attr("batch_axis", 1))
    steps = dims[time_axis]
    if not isinstance(steps, int):
        raise SymbolicError("reversing sequences of symbolic length")
    t = np.arange(steps, dtype=np.int64).reshape([-1 if i == time_axis else 1 for i in range(len(dims))])
    length = reshape_to(cv, lengths, [-1 if i == batch_axis else 1 for i in range(len(dims))])
    reverse = cv.emit("sub", cv.emit("sub", length, np.array(1, np.int64)), t)
    index = cv.emit("where", cv.emit("less", t, length), reverse, t)
    return cv.emit("gather", x, cv.emit("expand", index, shape=tuple(dims)), axis=time_axis)


@onnx_op("Unique")
def unique(cv, n):
    """The distinct elements (or slices along `axis`), sorted or in first-seen order, with where each is first
    seen, where each input's lands, and how often each occurs. All from one [n, n] table of which items equal
    which: an item is first seen where no earlier one equals it; its place among the distinct items is how
    many of those come before it (are smaller, when sorted); each output is scattered to those places, as
    many as the data holds."""
    x = n.inputs[0]
    dims, axis = list(cv.meta(x).shape), n.attr("axis")
    if axis is None:
        x, axis, dims = reshape_to(cv, x, (product(dims),)), 0, [product(dims)]
    axis = cv.axis(axis, len(dims))
    count = dims[axis]
    if not all(isinstance(d, int) for d in dims):
        raise SymbolicError("Unique over symbolic sizes")
    moved = cv.emit("permute", x, perm=(axis, *(i for i in range(len(dims)) if i != axis))) if axis else x
    items = reshape_to(cv, moved, (count, -1))                                    # [n, r]
    mine, theirs = reshape_to(cv, items, (count, 1, -1)), reshape_to(cv, items, (1, count, -1))
    same = cv.emit("equal", mine, theirs)                                         # [n, n, r]
    equal = cv.emit("reduce_min", cv.emit("cast", same, dtype="u8"), axes=(2,), keepdims=False)
    earlier = np.tril(np.ones((count, count), np.uint8), -1)                      # j < i
    repeated = cv.emit("reduce_max", cv.emit("mul", equal, earlier), axes=(1,), keepdims=False)
    first = cv.emit("equal", repeated, np.array(0, np.uint8))                     # [n]
    firsts = cv.emit("cast", first, dtype="i64")
    if n.attr("sorted", 1):                 # j's item lexicographically before i's: smaller where all before agree
        below = cv.emit("cast", cv.emit("less", theirs, mine), dtype="i64")
        agreed = cv.emit("slice", cv.emit("cumprod", cv.emit("cast", same, dtype="i64"), axis=2), axis=2, start=0, stop=-1)
        agreed = cv.emit("concat", np.ones((count, count, 1), np.int64), agreed, axis=2)       # all before k agree
        before = cv.emit("reduce_max", cv.emit("mul", below, agreed), axes=(2,), keepdims=False)
    else:                                   # j first seen before i's item was
        seen = cv.emit("argmax", cv.emit("cast", equal, dtype="i64"), axis=1)
        before = cv.emit("less", np.arange(count, dtype=np.int64)[None, :], reshape_to(cv, seen, (count, 1)))
        before = cv.emit("cast", before, dtype="i64")
    place = cv.emit("reduce_sum", cv.emit("mul", before, reshape_to(cv, firsts, (1, count))), axes=(1,), keepdims=False)
    positions = cv.emit("take", cv.emit("nonzero", first), np.array(0, np.int64), axis=0)   # [u], u the data's
    distinct = cv.meta(positions).shape[0]
    at = cv.emit("take", place, positions, axis=0)

    def placed(values):
        meta = cv.meta(values)
        empty = cv.emit("expand", np.zeros((1,) * meta.ndim, dtype(meta.dtype).numpy), shape=(distinct, *meta.shape[1:]))
        return cv.emit("scatter", empty, at, cv.emit("take", values, positions, axis=0), axis=0)
    values = reshape_to(cv, placed(items), (distinct, *(d for i, d in enumerate(dims) if i != axis)))
    if axis:
        values = cv.emit("permute", values, perm=(*range(1, axis + 1), 0, *range(axis + 1, len(dims))))
    counts = cv.emit("reduce_sum", cv.emit("cast", equal, dtype="i64"), axes=(1,), keepdims=False)
    return values, placed(np.arange(count, dtype=np.int64)), place, placed(counts)


@onnx_op("ArrayFeatureExtractor", domain="ai.onnx.ml")
def array_feature_extractor(cv, n):
    """The elements of the last axis at the given indices."""
    x, index = n.inputs
    return cv.emit("take", x, reshape_to(cv, index, (-1,)), axis=cv.meta(x).ndim - 1)


@onnx_op("Trilu")
def trilu(cv, n):
    x = n.inputs[0]
    k = int(cv.known(n.input(1), "diagonal", np.array(0)).reshape(-1)[0])
    rows, cols = cv.meta(x).shape[-2:]
    if not (isinstance(rows, int) and isinstance(cols, int)):
        raise SymbolicError("a triangle of symbolic size")
    keep = (np.triu if n.attr("upper", 1) else np.tril)(np.ones((rows, cols), np.bool_), k)
    return cv.emit("where", keep, x, scalar(cv, 0, x))


# --- reductions and selection ----------------------------------------------------------------

def reduce_axes(cv, n, x, attr_until):
    rank = cv.meta(x).ndim
    axes = axes_of(cv, n, rank, attr_until)
    if not axes:
        return None if n.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    return tuple(sorted(set(axes)))


REDUCE = {"ReduceSum": "reduce_sum", "ReduceMean": "reduce_mean", "ReduceMax": "reduce_max", "ReduceMin": "reduce_min",
          "ReduceProd": "reduce_prod", "ReduceL1": "reduce_sum", "ReduceL2": "reduce_sum", "ReduceSumSquare": "reduce_sum",
          "ReduceLogSum": "reduce_sum", "ReduceLogSumExp": "reduce_sum"}


@onnx_op(*REDUCE)
def reduce(cv, n):
    x = n.inputs[0]
    axes = reduce_axes(cv, n, x, 13 if n.op_type == "ReduceSum" else 18)
    if axes is None:
        return x
    keep = bool(n.attr("keepdims", 1))
    op = n.op_type
    if op == "ReduceLogSumExp":
        top = cv.emit("reduce_max", x, axes=axes, keepdims=True)
        sums = cv.emit("reduce_sum", cv.emit("exp", cv.emit("sub", x, top)), axes=axes, keepdims=keep)
        return cv.emit("add", cv.emit("log", sums), top if keep else cv.emit("reduce_max", x, axes=axes, keepdims=False))
    if cv.meta(x).dtype == "bool" and op in ("ReduceMax", "ReduceMin"):      # any / all
        y = cv.emit(REDUCE[op], cv.emit("cast", x, dtype="u8"), axes=axes, keepdims=keep)
        return cv.emit("cast", y, dtype="bool")
    if op == "ReduceL1":
        x = cv.emit("abs", x)
    elif op in ("ReduceL2", "ReduceSumSquare"):
        x = cv.emit("mul", x, x)
    y = cv.emit(REDUCE[op], x, axes=axes, keepdims=keep)
    if op == "ReduceL2":
        return cv.emit("sqrt", y)
    return cv.emit("log", y) if op == "ReduceLogSum" else y


def flipped(cv, x, axis):
    size = cv.meta(x).shape[axis]
    if not isinstance(size, int):
        raise SymbolicError(f"reversing symbolic axis {size}")
    return cv.emit("take", x, np.arange(size - 1, -1, -1, dtype=np.int64), axis=axis), size


@onnx_op("ArgMax", "ArgMin")
def arg_extreme(cv, n):
    x = n.inputs[0]
    dims = cv.meta(x).shape
    axis = cv.axis(n.attr("axis", 0), len(dims))
    if n.op_type == "ArgMin":
        x = reversed_order(cv, x)
    last = n.attr("select_last_index", 0)
    if last:
        x, size = flipped(cv, x, axis)
    index = cv.emit("argmax", x, axis=axis)
    if last:
        index = cv.emit("sub", np.array(size - 1, np.int64), index)
    if n.attr("keepdims", 1):
        index = reshape_to(cv, index, [1 if i == axis else d for i, d in enumerate(dims)])
    return index


@onnx_op("Hardmax")
def hardmax(cv, n):
    """1 where each row's first largest value is, 0 elsewhere (before opset 13, rows of the flattened tail)."""
    x = n.inputs[0]
    dims = cv.meta(x).shape
    axis = cv.axis(n.attr("axis", 1 if n.opset < 13 else -1), len(dims))
    rows = x if n.opset >= 13 else reshape_to(cv, x, (product(dims[:axis]), product(dims[axis:])))
    axis = axis if n.opset >= 13 else 1
    shape = cv.meta(rows).shape
    if not isinstance(shape[axis], int):
        raise SymbolicError(f"hardmax over symbolic axis {shape[axis]}")
    index = reshape_to(cv, cv.emit("argmax", rows, axis=axis), [1 if i == axis else d for i, d in enumerate(shape)])
    positions = np.arange(shape[axis], dtype=np.int64).reshape([-1 if i == axis else 1 for i in range(len(shape))])
    hot = cv.emit("cast", cv.emit("equal", index, positions), dtype=cv.meta(x).dtype)
    return hot if n.opset >= 13 else reshape_to(cv, hot, dims)


@onnx_op("OneHot")
def one_hot(cv, n):
    """on where an index (negative from the end of depth) equals its position along the new axis, else off."""
    index, depth, values = n.inputs
    depth = int(np.asarray(cv.known(depth, "depth")).reshape(-1)[0])
    rank = cv.meta(index).ndim + 1
    axis = cv.axis(n.attr("axis", -1), rank)
    index = cv.emit("cast", index, dtype="i64") if cv.meta(index).dtype != "i64" else index
    negative = cv.emit("less", index, np.array(0, np.int64))
    index = cv.emit("where", negative, cv.emit("add", index, np.array(depth, np.int64)), index)
    dims = list(cv.meta(index).shape)
    dims.insert(axis, 1)
    positions = np.arange(depth, dtype=np.int64).reshape([-1 if i == axis else 1 for i in range(rank)])
    hot = cv.emit("equal", reshape_to(cv, index, dims), positions)
    off, on = (cv.emit("take", values, np.array(i, np.int64), axis=0) for i in (0, 1))
    return cv.emit("where", hot, on, off)


@onnx_op("EyeLike")
def eye_like(cv, n):
    x = n.inputs[0]
    rows, cols = cv.meta(x).shape
    if not (isinstance(rows, int) and isinstance(cols, int)):
        raise SymbolicError(f"EyeLike of symbolic shape {[rows, cols]}")
    to = dtype_name(n.attr("dtype"), cv.where()) if n.attr("dtype") is not None else cv.meta(x).dtype
    return np.eye(rows, cols, k=int(n.attr("k", 0)), dtype=dtype(to).numpy)


@onnx_op("GatherND")
def gather_nd(cv, n):
    """data[index[..., :]]: the first K axes (after `batch_dims`) of data flattened into one, each index
    tuple made one position in it (negative ones counted from the end), then a take along that axis."""
    data, index = n.inputs
    dims, b = cv.meta(data).shape, int(n.attr("batch_dims", 0))
    k = cv.meta(index).shape[-1]
    if not isinstance(k, int):
        raise SymbolicError("GatherND with index tuples of symbolic length")
    flat = flat_positions(cv, index, dims[b:b + k])
    if b == 0:
        rows = reshape_to(cv, data, (product(dims[:k]),) + tuple(dims[k:]))
        return cv.emit("take", rows, flat, axis=0)
    batches = product(dims[:b])                          # each batch's rows offset by its own block
    offsets = np.arange(batches, dtype=np.int64).reshape((batches,) + (1,) * (cv.meta(flat).ndim - b)) * product(dims[b:b + k])
    flat = cv.emit("add", reshape_to(cv, flat, (batches,) + tuple(cv.meta(flat).shape[b:])), offsets)
    rows = reshape_to(cv, data, (batches * product(dims[b:b + k]),) + tuple(dims[b + k:]))
    out = cv.emit("take", rows, flat, axis=0)
    return reshape_to(cv, out, tuple(cv.meta(index).shape[:-1]) + tuple(dims[b + k:]))


def scattering(cv, n, x, index, updates):
    """The IR's scatter (along axis 0 of flattened rows) or, for a `reduction`, its scatter_reduce."""
    reduction = n.attr("reduction", "none")
    if reduction == "none":
        return cv.emit("scatter", x, index, updates, axis=0)
    if reduction not in ("add", "mul", "max", "min"):
        raise cv.unsupported(f"scatter with reduction {reduction!r}")
    return cv.emit("scatter_reduce", x, index, updates, axis=0, reduction=reduction)


@onnx_op("ScatterND")
def scatter_nd(cv, n):
    """data with the slices at index tuples replaced: the first K axes flattened into one, each tuple one
    position along it, written by the IR's scatter."""
    data, index, updates = n.inputs
    dims, k = cv.meta(data).shape, cv.meta(index).shape[-1]
    if not isinstance(k, int):
        raise SymbolicError("ScatterND with index tuples of symbolic length")
    flat = reshape_to(cv, flat_positions(cv, index, dims[:k]), (-1,))
    rows = reshape_to(cv, data, (product(dims[:k]),) + tuple(dims[k:]))
    written = scattering(cv, n, rows, flat, reshape_to(cv, updates, (-1,) + tuple(dims[k:])))
    return reshape_to(cv, written, dims)


@onnx_op("ScatterElements", "Scatter")
def scatter_elements(cv, n):
    data, index, updates = n.inputs
    return scattered_elements(cv, n, data, index, updates, cv.axis(n.attr("axis", 0), cv.meta(data).ndim))


@onnx_op("TensorScatter")
def tensor_scatter(cv, n):
    """A cache's update written at each batch entry's write index along `axis` (consecutive positions; in
    circular mode wrapping past the end)."""
    cache, update, starts = n.inputs[0], n.inputs[1], n.input(2)
    dims, shape = cv.meta(cache).shape, cv.meta(update).shape
    axis = cv.axis(n.attr("axis", -2), len(dims))
    starts = np.zeros(dims[0], np.int64) if starts is None else starts
    at = [-1 if i == 0 else 1 for i in range(len(dims))]
    steps = np.arange(shape[axis], dtype=np.int64).reshape([-1 if i == axis else 1 for i in range(len(dims))])
    index = cv.emit("add", reshape_to(cv, cv.emit("cast", starts, dtype="i64"), at), steps)
    if n.attr("mode", "linear") == "circular":
        index = cv.emit("mod", index, np.array(dims[axis], np.int64))
    return scattered_elements(cv, n, cache, cv.emit("expand", index, shape=tuple(shape)), update, axis)


def scattered_elements(cv, n, data, index, updates, axis):
    """Each update to its own element: its position with the axis coordinate replaced by its index, all
    of them written into the flattened data."""
    dims, shape = cv.meta(data).shape, cv.meta(index).shape
    if not all(isinstance(d, int) for d in (*dims, *shape)):
        raise SymbolicError("a scatter of elements over symbolic sizes")
    strides = [product(dims[i + 1:]) for i in range(len(dims))]
    base = sum(np.arange(size, dtype=np.int64).reshape([-1 if i == d else 1 for i in range(len(shape))]) * strides[d]
               for d, size in enumerate(shape) if d != axis)
    index = cv.emit("cast", index, dtype="i64") if cv.meta(index).dtype != "i64" else index
    index = cv.emit("where", cv.emit("less", index, np.array(0, np.int64)), cv.emit("add", index, np.array(dims[axis], np.int64)),
                    index)
    flat = cv.emit("add", cv.emit("mul", index, np.array(strides[axis], np.int64)), np.asarray(base, np.int64))
    written = scattering(cv, n, reshape_to(cv, data, (-1,)), reshape_to(cv, flat, (-1,)), reshape_to(cv, updates, (-1,)))
    return reshape_to(cv, written, dims)


def flat_positions(cv, index, sizes):
    """Index tuples (the last axis of `index`) as positions in the row-major flattening of `sizes`."""
    index = cv.emit("cast", index, dtype="i64") if cv.meta(index).dtype != "i64" else index
    index = cv.emit("where", cv.emit("less", index, np.array(0, np.int64)), cv.emit("add", index, dims_array(sizes)), index)
    strides = dims_array([product(sizes[i + 1:]) for i in range(len(sizes))])
    return cv.emit("reduce_sum", cv.emit("mul", index, strides), axes=(-1,), keepdims=False)


@onnx_op("TopK")
def topk(cv, n):
    """The k largest (smallest) along an axis. A k the data decides: the whole axis ordered, its first k
    taken (a count bound when the graph runs)."""
    x = n.inputs[0]
    axis = cv.axis(n.attr("axis", -1), cv.meta(x).ndim)
    counted = n.opset >= 10 and not isinstance(n.inputs[1], np.ndarray)
    if counted and not isinstance(cv.meta(x).shape[axis], int):
        raise SymbolicError("TopK of a computed k over a symbolic axis")
    k = cv.meta(x).shape[axis] if counted else int(n.attr("k")) if n.opset < 10 else \
        cv.ints(n.inputs[1], "k", symbolic=True)[0]          # a size (min(300, boxes found)) bound as the graph runs
    if n.attr("largest", 1):
        values, index = cv.emit("topk", x, k=k, axis=axis)
    else:
        values, index = cv.emit("topk", reversed_order(cv, x), k=k, axis=axis)
        values = reversed_order(cv, values)
    if not counted:
        return values, index
    first = cv.emit("range", np.array(0, np.int64), reshape_to(cv, n.inputs[1], ()), np.array(1, np.int64))
    return cv.emit("take", values, first, axis=axis), cv.emit("take", index, first, axis=axis)


def reversed_order(cv, x):
    """x mapped so that larger is smaller, exactly and reversibly: -x, and for integers ~x (-x wraps)."""
    dt = dtype(cv.meta(x).dtype).numpy
    if dt.kind not in "iu":
        return cv.emit("neg", x)
    return cv.emit("sub", np.array(np.iinfo(dt).max if dt.kind == "u" else -1, dt), x)


@onnx_op("CumSum", "CumProd")
def cumulative(cv, n):
    """Running sums or products; exclusive ones run over the input shifted by one (the identity first)."""
    x = n.inputs[0]
    axis = cv.axis(cv.ints(n.inputs[1], "axis")[0], cv.meta(x).ndim)
    reverse = n.attr("reverse", 0)
    if reverse:
        x, _ = flipped(cv, x, axis)
    if n.attr("exclusive", 0):
        dims = list(cv.meta(x).shape)
        dims[axis] = 1
        identity = np.full(dims, 0 if n.op_type == "CumSum" else 1, dtype(cv.meta(x).dtype).numpy)
        x = cv.emit("concat", identity, cv.emit("slice", x, axis=axis, start=0, stop=-1), axis=axis)
    y = cv.emit("cumsum" if n.op_type == "CumSum" else "cumprod", x, axis=axis)
    return flipped(cv, y, axis)[0] if reverse else y


@onnx_op("DepthToSpace", "SpaceToDepth")
def depth_space(cv, n):
    x = n.inputs[0]
    b, c, h, w = cv.meta(x).shape
    s = int(n.attr("blocksize"))
    if n.op_type == "SpaceToDepth":
        y = reshape_to(cv, x, (b, c, h // s, s, w // s, s))
        perm = (0, 3, 5, 1, 2, 4) if n.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
        return reshape_to(cv, cv.emit("permute", y, perm=perm), (b, c * s * s, h // s, w // s))
    if n.attr("mode", "DCR") == "DCR":
        y, perm = reshape_to(cv, x, (b, s, s, c // (s * s), h, w)), (0, 3, 4, 1, 5, 2)
    else:
        y, perm = reshape_to(cv, x, (b, c // (s * s), s, s, h, w)), (0, 1, 4, 2, 5, 3)
    return reshape_to(cv, cv.emit("permute", y, perm=perm), (b, c // (s * s), h * s, w * s))

"""Views and copies that move data: reshape, permute, slice, concat, split, gather; and selection: argmax, top-k, sample."""
from __future__ import annotations

import math
from collections import Counter

from soma_runtime.ir.graph import Sym, TensorMeta, dim_min, is_dynamic, same_dim
from soma_runtime.ir.ops.base import check, concat_atoms, dim_prod, float_dtype, op, same_dtype


def reshape_rule(metas, attrs):
    x, shape = metas[0], [d if isinstance(d, (int, Sym)) else Sym(d) for d in attrs["shape"]]
    check(sum(1 for d in shape if d == -1) <= 1, "at most one -1 in a reshape")
    total = dim_prod(x.shape)
    if -1 in shape:
        shape[shape.index(-1)] = inferred_dim(x.shape, [d for d in shape if d != -1], attrs["shape"])
    if isinstance(total, int) and all(isinstance(d, int) for d in shape):
        check(dim_prod(shape) == total, f"cannot reshape {list(x.shape)} to {attrs['shape']}")
    return [TensorMeta(tuple(shape), x.dtype)]


@op("reshape", ["x"], reshape_rule, attrs={"shape": ()}, view=True)
def reshape(A, x, shape): return A.read("reshape", x, shape=shape)


def inferred_dim(source, known, target):
    """The -1 of a reshape: symbolic factors common to both sides cancel, so (B, S, 128) -> (B, S, 2, -1) gives 64
    and ((B*12), 197, 64) -> (-1, 12, 197, 64) gives B."""
    syms, src = Counter(), 1
    for d in source:
        names, coefficient = factors(d)
        syms.update(names)
        src *= coefficient
    dst = 1
    for d in known:
        names, coefficient = factors(d)
        if any(syms[name] < n for name, n in names.items()):
            return dim_prod(source) // dim_prod(known)
        syms.subtract(names)
        dst *= coefficient
    check(dst and src % dst == 0, f"cannot reshape {list(source)} to {list(target)}")
    leftover = [Sym(name) for name, n in syms.items() for _ in range(n)]
    return dim_prod(leftover) * (src // dst) if leftover else src // dst


def factors(d) -> tuple[Counter, int]:
    """A size as a product: its symbolic factors (by expression) and its integer coefficient; (B*12) gives
    ({B: 1}, 12), ((B*3)*4) gives ({B: 1}, 12), a number n gives ({}, n), any other expression itself."""
    if isinstance(d, int):
        return Counter(), d
    expr = d.expr
    depth = 0
    for i, ch in enumerate(expr):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and i < len(expr) - 1:
            break                                   # the outer parentheses do not enclose it all
        if depth == 1 and ch == "*":
            left, right = expr[1:i], expr[i + 1:-1]
            names, coefficient = Counter(), 1
            for side in (left, right):
                n, k = factors(int(side) if side.lstrip("-").isdigit() else Sym(side))
                names.update(n)
                coefficient *= k
            return names, coefficient
    return Counter({expr: 1}), 1


def permute_rule(metas, attrs):
    x, perm = metas[0], attrs["perm"]
    check(sorted(p % x.ndim for p in perm) == list(range(x.ndim)), f"{list(perm)} is not a permutation of {x.ndim} axes")
    return [TensorMeta(tuple(x.shape[p] for p in perm), x.dtype)]


@op("permute", ["x"], permute_rule, attrs={"perm": ()}, view=True)
def permute(A, x, perm): return A.read("permute", x, perm=perm)


def transpose_rule(metas, attrs):
    x = metas[0]
    shape = list(x.shape)
    a, b = attrs["dim0"] % x.ndim, attrs["dim1"] % x.ndim
    shape[a], shape[b] = shape[b], shape[a]
    return [TensorMeta(tuple(shape), x.dtype)]


@op("transpose", ["x"], transpose_rule, attrs={"dim0": -2, "dim1": -1}, view=True)
def transpose(A, x, dim0, dim1): return A.read("transpose", x, axis1=dim0, axis2=dim1)


def slice_length(n, start, stop, step):
    """Elements in x[start:stop:step] of an axis of n; a symbolic stop (a length the data binds) is taken
    to be within the axis, and a number past an axis the data sizes is held to it (a detector's most boxes)."""
    if isinstance(n, int) and not isinstance(stop, Sym) and not isinstance(start, Sym):
        return len(range(*slice(start, stop, step).indices(n)))
    if is_dynamic(n) and isinstance(stop, int) and stop >= 0 and isinstance(start, int) and start >= 0:
        stop = dim_min(stop, n)
    if isinstance(start, int) and start < 0 and stop is None and step == 1:     # a tail, e.g. the last token
        return -start
    stop = n if stop is None else stop
    return (stop - start + step - 1) // step


def slice_rule(metas, attrs):
    x = metas[0]
    axis = attrs["axis"] % x.ndim
    check(attrs["step"] > 0, "slice step must be positive")
    shape = list(x.shape)
    shape[axis] = slice_length(shape[axis], attrs["start"], attrs["stop"], attrs["step"])
    return [TensorMeta(tuple(shape), x.dtype)]


@op("slice", ["x"], slice_rule, attrs={"axis": 0, "start": 0, "stop": None, "step": 1}, struct={"step": (1, 2)}, view=True)
def slice_(A, x, axis, start, stop, step):
    return A.read("slice", x, axis=axis, start=start, stop=stop, step=step)


def concat_rule(metas, attrs):
    dt = same_dtype(*metas)
    first = metas[0]
    axis = attrs["axis"] % first.ndim
    for m in metas[1:]:
        agree = all(same_dim(a, b) is not False for i, (a, b) in enumerate(zip(m.shape, first.shape)) if i != axis)
        check(m.ndim == first.ndim and agree,
              f"concat inputs {[list(m.shape) for m in metas]} differ off axis {attrs['axis']}")
    shape = list(first.shape)
    shape[axis] = sum_dims([m.shape[axis] for m in metas])
    return [TensorMeta(tuple(shape), dt)]


def sum_dims(dims):
    total = 0
    for d in dims:
        total = total + d
    return total


@op("concat", ["xs*"], concat_rule, attrs={"axis": 0})
def concat(A, *xs, axis):
    shape = list(xs[0].shape)
    lengths = [x.shape[axis] for x in xs]
    shape[axis] = sum_dims(lengths)
    offsets = [sum_dims(lengths[:i]) for i in range(len(xs))]
    return concat_atoms(A, xs, axis, tuple(shape), offsets)


def split_rule(metas, attrs):
    x = metas[0]
    axis = attrs["axis"] % x.ndim
    if isinstance(x.shape[axis], int):
        check(sum(attrs["sizes"]) == x.shape[axis], f"split sizes {list(attrs['sizes'])} do not sum to {x.shape[axis]}")
    return [TensorMeta(tuple(s if i != axis else n for i, s in enumerate(x.shape)), x.dtype) for n in attrs["sizes"]]


@op("split", ["x"], split_rule, attrs={"sizes": (), "axis": 0},
    struct={"sizes": tuple((1,) * n for n in range(1, 17))}, view=True)
def split(A, x, sizes, axis):
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(A.read("slice", x, axis=axis, start=s, stop=s + n) for s, n in zip(starts, sizes))


def gather_rule(metas, attrs):
    x, index = metas
    check(index.dtype in ("i32", "i64"), "index must be integer")
    check(index.ndim == x.ndim, "gather index must have the rank of x")
    return [TensorMeta(index.shape, x.dtype)]


@op("gather", ["x", "index"], gather_rule, attrs={"axis": 0})
def gather(A, x, index, axis): return A.read("take_along", x, index, axis=axis)


def argmax_rule(metas, attrs):
    x = metas[0]
    axis = attrs["axis"] % x.ndim
    return [TensorMeta(tuple(d for i, d in enumerate(x.shape) if i != axis), "i64")]


@op("argmax", ["x"], argmax_rule, attrs={"axis": -1})
def argmax(A, x, axis): return A.reduce("argmax", x, axis=axis, keepdims=False)


def topk_rule(metas, attrs):
    x = metas[0]
    axis = attrs["axis"] % x.ndim
    if isinstance(x.shape[axis], int):
        check(0 < attrs["k"] <= x.shape[axis], f"k={attrs['k']} out of range for size {x.shape[axis]}")
    shape = tuple(attrs["k"] if i == axis else d for i, d in enumerate(x.shape))
    return [TensorMeta(shape, x.dtype), TensorMeta(shape, "i64")]


@op("topk", ["x"], topk_rule, attrs={"k": 1, "axis": -1})
def topk(A, x, k, axis):
    index = A.reduce("topk", x, axis=axis, k=k)
    return A.read("take_along", x, index, axis=axis), index


def sample_rule(metas, attrs):
    logits, params = metas
    float_dtype(logits, "logits")
    check(logits.ndim == 2, f"sample takes logits [rows, vocab], got {list(logits.shape)}")
    check(params.dtype == "f32" and params.ndim == 2 and same_dim(params.shape[0], logits.shape[0]) is not False
          and same_dim(params.shape[1], 5) is not False,
          f"params must be f32 [{logits.shape[0]}, 5], got {params.dtype} {list(params.shape)}")
    if isinstance(logits.shape[1], int):
        check(1 <= attrs["width"] <= logits.shape[1],
              f"width={attrs['width']} out of range for a vocabulary of {logits.shape[1]}")
    return [TensorMeta((logits.shape[0],), "i64")]


@op("sample", ["logits", "params"], sample_rule, attrs={"width": 64})
def sample(A, logits, params, width):
    """Each row's token from its params row (temperature, top_k, top_p, min_p, u). Temperature 0 takes
    the most likely. Otherwise, over the `width` most likely tokens (top_k outside [1, width] counts as
    width): logits / temperature -> top-k (ties at the k-th kept) -> top-p (the most likely first,
    until their probability reaches top_p) -> min-p (probability >= min_p x the top one's) -> the draw:
    the first survivor, in token order, whose share of the cumulative probability exceeds u."""
    ids = A.reduce("topk", logits, axis=-1, k=width)                      # [R, W], most likely first
    v = A.read("take_along", logits, ids, axis=-1)
    t, k, top_p, min_p, u = (A.read("slice", params, axis=1, start=i, stop=i + 1) for i in range(5))
    rank = A.read("iota", n=width, axis=1, ndim=2)
    greedy = A.cmp("eq", t, A.lit(0.0))
    x = A.mul(v, A.exp("recip", A.cmp("select", greedy, A.lit(1.0), t)))
    kth = A.reduce("max", A.cmp("select", A.cmp("eq", rank, A.sub(k, A.lit(1.0))), v, A.lit(-math.inf)), axis=1)
    live = A.cmp("le", kth, v)
    e = A.cmp("select", live, A.exp("exp", A.sub(x, A.reduce("max", x, axis=1))), A.lit(0.0))
    prob = A.mul(e, A.exp("recip", A.reduce("sum", e, axis=1)))

    def pairwise_sum(w, pairs):             # out[r, j] = sum over i of w[r, i] * pairs[r, i, j]
        return A.reduce("sum", A.mul(A.read("expand", w, axis=2), pairs), axis=1, keepdims=False)

    before = pairwise_sum(prob, A.cmp("lt", A.read("iota", n=width, axis=1, ndim=3), A.read("iota", n=width, axis=2, ndim=3)))
    nucleus = A.cmp("max", A.cmp("lt", before, top_p), A.cmp("le", A.lit(1.0), top_p))
    keep = A.mul(A.mul(live, nucleus), A.cmp("le", min_p, e))
    w = A.cmp("select", keep, e, A.lit(0.0))
    cdf = pairwise_sum(w, A.cmp("le", A.read("expand", ids, axis=2), A.read("expand", ids, axis=1)))
    hit = A.mul(keep, A.cmp("lt", u, A.mul(cdf, A.exp("recip", A.reduce("sum", w, axis=1)))))
    drawn = A.reduce("min", A.cmp("select", hit, ids, A.lit(math.inf)), axis=1)
    chosen = A.cmp("select", greedy, A.read("slice", ids, axis=1, start=0, stop=1), drawn)
    return A.read("cast", A.read("reshape", chosen, shape=(-1,)), struct=("i64",))

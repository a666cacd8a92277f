"""Convolution (and transposed), pooling and resampling."""
from __future__ import annotations

import math

from soma_runtime.ir.graph import Sym, TensorMeta
from soma_runtime.ir.ops.base import as_tuple, check, float_dtype, op, same_dtype, sigmoid_atoms


def conv_out(n, k, stride, pad, dil):
    return (n + 2 * pad - dil * (k - 1) - 1) // stride + 1


def conv_rule(nd):
    def rule(metas, attrs):
        x, w, b = metas[0], metas[1], metas[2] if len(metas) > 2 else None
        dt = same_dtype(x, w, b)
        float_dtype(x)
        check(x.ndim == nd + 2 and w.ndim == nd + 2, f"conv{nd}d takes x [N, C, *{nd} dims] and w [O, C/groups, *{nd} kernel]")
        g = attrs["groups"]
        if isinstance(x.shape[1], int) and isinstance(w.shape[1], int):
            check(x.shape[1] == w.shape[1] * g, f"input channels {x.shape[1]} != {w.shape[1]} x groups {g}")
        if isinstance(w.shape[0], int):
            check(w.shape[0] % g == 0, f"output channels {w.shape[0]} not divisible by groups {g}")
        if b is not None:
            check(b.ndim == 1, "conv bias must be 1-D")
        st, pd, dl = (as_tuple(attrs[k], nd) for k in ("stride", "padding", "dilation"))
        spatial = tuple(conv_out(n, k, s, p, d) for n, k, s, p, d in zip(x.shape[2:], w.shape[2:], st, pd, dl))
        check(all(not isinstance(s, int) or s > 0 for s in spatial), "kernel larger than padded input")
        shape = (x.shape[0], w.shape[0]) + spatial
        if len(metas) > 3 and metas[3] is not None:
            r = metas[3]
            check(r.dtype == dt and r.ndim == len(shape) and all(
                not (isinstance(a, int) and isinstance(b, int)) or a == b for a, b in zip(r.shape, shape)),
                f"a convolution's residual must be its output's shape {list(shape)} and dtype {dt}")
        check(attrs.get("epilogue", "none") in CONV_EPILOGUES,
              f"epilogue must be one of {', '.join(CONV_EPILOGUES)}, got {attrs.get('epilogue')!r}")
        return [TensorMeta(shape, dt)]
    return rule


def pad_atoms(A, x, pads, value, x_shape=None):
    nd, x_shape = len(pads), x_shape or x.shape
    shape = tuple(x_shape[:-nd]) + tuple(n + 2 * p for n, p in zip(x_shape[-nd:], pads))
    dst = A.read("fill", shape=shape, value=value)
    return A.write("place", dst, x, axes=tuple(range(-nd, 0)), starts=tuple(pads), steps=(1,) * nd)


CONV_EPILOGUES = ("none", "relu", "relu6", "silu")      # what a convolution may apply to its sum (bias and residual in)


def epilogue_atoms(A, y, epilogue):
    if epilogue == "relu":
        return A.cmp("max", y, A.lit(0))
    if epilogue == "relu6":
        return A.cmp("min", A.cmp("max", y, A.lit(0)), A.lit(6))
    return A.mul(y, sigmoid_atoms(A, y)) if epilogue == "silu" else y


def conv_atoms(A, x, w, b, stride, padding, dilation, groups, nd, x_shape=None, w_shape=None):
    """A convolution of x and w (of these shapes, where they are intermediates that carry none)."""
    x_shape, w_shape = x_shape or x.shape, w_shape or w.shape
    N, C = x_shape[:2]
    O, kernel = w_shape[0], tuple(w_shape[2:])
    st, pd, dl = as_tuple(stride, nd), as_tuple(padding, nd), as_tuple(dilation, nd)
    spatial = tuple(conv_out(n, k, s, p, d) for n, k, s, p, d in zip(x_shape[2:], kernel, st, pd, dl))
    windows = A.slide(pad_atoms(A, x, pd, 0.0, x_shape), axes=tuple(range(2, 2 + nd)), window=kernel, stride=st,
                      dilation=dl)
    xg = A.read("reshape", windows, shape=(N, groups, 1, C // groups) + spatial + kernel)
    wg = A.read("reshape", w, shape=(1, groups, O // groups, C // groups) + (1,) * nd + kernel)
    summed_axes = (3,) + tuple(range(4 + nd, 4 + 2 * nd))
    y = A.read("reshape", A.reduce("sum", A.mul(xg, wg), axis=summed_axes, keepdims=False), shape=(N, O) + spatial)
    return y if b is None else A.add(y, A.read("reshape", b, shape=(O,) + (1,) * nd))


def fused_conv_atoms(A, x, w, b, residual, epilogue, nd, **attrs):
    """epilogue(conv(x, w) + b + residual): a block's convolution with the stream it joins and its activation."""
    y = conv_atoms(A, x, w, b, nd=nd, **attrs)
    return epilogue_atoms(A, y if residual is None else A.add(y, residual), epilogue)


CONV_ATTRS = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1, "epilogue": "none"}


@op("conv1d", ["x", "weight", "bias?", "residual?"], conv_rule(1), attrs=CONV_ATTRS, tol=4.0, ranks=(3, 3, 1, 3),
    struct={"epilogue": CONV_EPILOGUES})
def conv1d(A, x, weight, bias, residual, **attrs): return fused_conv_atoms(A, x, weight, bias, residual, nd=1, **attrs)


@op("conv2d", ["x", "weight", "bias?", "residual?"], conv_rule(2), attrs=CONV_ATTRS, tol=4.0, ranks=(4, 4, 1, 4),
    struct={"epilogue": CONV_EPILOGUES})
def conv2d(A, x, weight, bias, residual, **attrs): return fused_conv_atoms(A, x, weight, bias, residual, nd=2, **attrs)


def transposed_out(n, k, stride, dil, crop):
    """A transposed convolution's length: every input's window laid `stride` apart, less the crop at each end."""
    return stride * (n - 1) + dil * (k - 1) + 1 - crop[0] - crop[1]


def conv_transpose_rule(nd):
    def rule(metas, attrs):
        x, w, b = metas[0], metas[1], metas[2] if len(metas) > 2 else None
        dt = same_dtype(x, w, b)
        float_dtype(x)
        check(x.ndim == nd + 2 and w.ndim == nd + 2,
              f"conv_transpose{nd}d takes x [N, C, *{nd} dims] and w [C, O/groups, *{nd} kernel]")
        if isinstance(x.shape[1], int) and isinstance(w.shape[0], int):
            check(x.shape[1] == w.shape[0] and w.shape[0] % attrs["groups"] == 0,
                  f"input channels {x.shape[1]} != weight's {w.shape[0]} (a multiple of groups {attrs['groups']})")
        if b is not None:
            check(b.ndim == 1, "conv bias must be 1-D")
        st, dl = as_tuple(attrs["stride"], nd), as_tuple(attrs["dilation"], nd)
        crops = tuple(attrs["crop"]) or ((0, 0),) * nd
        check(len(crops) == nd and all(0 <= c[0] < (k - 1) * d + 1 and c[1] < (k - 1) * d + 1
                                       for c, k, d in zip(crops, w.shape[2:], dl)),
              f"crop {list(crops)} must be (begin, end) per axis, each less than the kernel's span (end < 0 extends)")
        spatial = tuple(transposed_out(n, k, s, d, c) for n, k, s, d, c in zip(x.shape[2:], w.shape[2:], st, dl, crops))
        return [TensorMeta((x.shape[0], w.shape[1] * attrs["groups"]) + spatial, dt)]
    return rule


def conv_transpose_atoms(A, x, w, b, stride, dilation, groups, crop, nd):
    """The convolution whose gradient it is: the inputs `stride` apart with zeros between, padded by the
    kernel's span less the crop, convolved with the kernel flipped and its in and out channels swapped."""
    N, C = x.shape[:2]
    O, kernel = w.shape[1] * groups, tuple(w.shape[2:])
    st, dl = as_tuple(stride, nd), as_tuple(dilation, nd)
    crops = tuple(crop) or ((0, 0),) * nd
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dl)]
    out = [transposed_out(n, k, s, d, c) for n, k, s, d, c in zip(x.shape[2:], kernel, st, dl, crops)]
    spread_shape = (N, C) + tuple(n + span - 1 for n, span in zip(out, spans))
    spread = A.read("fill", shape=spread_shape, value=0.0)
    spread = A.write("place", spread, x, axes=tuple(range(2, 2 + nd)),
                     starts=tuple(span - 1 - c[0] for span, c in zip(spans, crops)), steps=st)
    for axis, k in enumerate(kernel):
        reversed_ = A.add(A.mul(A.read("iota", n=k, axis=0, ndim=1), A.lit(-1)), A.param(k - 1))
        w = A.read("take", w, A.read("cast", reversed_, struct=("i64",)), axis=2 + axis)
    w = A.read("reshape", w, shape=(groups, C // groups, O // groups) + kernel)
    w = A.read("reshape", A.read("permute", w, perm=(0, 2, 1) + tuple(range(3, 3 + nd))), shape=(O, C // groups) + kernel)
    return conv_atoms(A, spread, w, b, (1,) * nd, (0,) * nd, dl, groups, nd, spread_shape, (O, C // groups) + kernel)


CONV_TRANSPOSE_ATTRS = {"stride": 1, "dilation": 1, "groups": 1, "crop": ()}


@op("conv_transpose1d", ["x", "weight", "bias?"], conv_transpose_rule(1), attrs=CONV_TRANSPOSE_ATTRS, tol=4.0,
    ranks=(3, 3, 1), struct={"stride": (1, 2)})                  # inputs spread apart are a strided write
def conv_transpose1d(A, x, weight, bias, **attrs): return conv_transpose_atoms(A, x, weight, bias, nd=1, **attrs)


@op("conv_transpose2d", ["x", "weight", "bias?"], conv_transpose_rule(2), attrs=CONV_TRANSPOSE_ATTRS, tol=4.0,
    ranks=(4, 4, 1), struct={"stride": ((1, 1), (2, 2))})
def conv_transpose2d(A, x, weight, bias, **attrs): return conv_transpose_atoms(A, x, weight, bias, nd=2, **attrs)


@op("conv_transpose3d", ["x", "weight", "bias?"], conv_transpose_rule(3), attrs=CONV_TRANSPOSE_ATTRS, tol=4.0,
    ranks=(5, 5, 1), struct={"stride": ((1, 1, 1), (2, 2, 2))})
def conv_transpose3d(A, x, weight, bias, **attrs): return conv_transpose_atoms(A, x, weight, bias, nd=3, **attrs)


def pool_rule(metas, attrs):
    x = metas[0]
    float_dtype(x)
    k = attrs["kernel"]
    nd = len(k)
    check(nd in (1, 2, 3) and x.ndim == nd + 2, f"pooling with a {nd}-D kernel takes x [N, C, *{nd} dims]")
    st = as_tuple(attrs["stride"] or k, nd)
    pd = as_tuple(attrs["padding"], nd)
    check(all(p * 2 <= kk for p, kk in zip(pd, k)), "padding must be at most half the kernel")
    spatial = tuple(conv_out(n, kk, s, p, 1) for n, kk, s, p in zip(x.shape[2:], k, st, pd))
    return [TensorMeta(tuple(x.shape[:2]) + spatial, x.dtype)]


def pool_atoms(A, x, kernel, stride, padding, mode, pad_value):
    nd = len(kernel)
    st, pd = as_tuple(stride or kernel, nd), as_tuple(padding, nd)
    windows = A.slide(pad_atoms(A, x, pd, pad_value), axes=tuple(range(2, 2 + nd)), window=tuple(kernel),
                      stride=st, dilation=(1,) * nd)
    return A.reduce(mode, windows, axis=tuple(range(-nd, 0)), keepdims=False)


POOL_ATTRS = {"kernel": (2, 2), "stride": None, "padding": 0}


@op("max_pool", ["x"], pool_rule, attrs=POOL_ATTRS, ranks=(4,))
def max_pool(A, x, **attrs): return pool_atoms(A, x, mode="max", pad_value=-math.inf, **attrs)


@op("avg_pool", ["x"], pool_rule, attrs=POOL_ATTRS, ranks=(4,))
def avg_pool(A, x, **attrs): return pool_atoms(A, x, mode="mean", pad_value=0.0, **attrs)


def interpolate_rule(metas, attrs):
    x = metas[0]
    float_dtype(x)
    size = tuple(attrs["size"])
    check(len(size) in (1, 2) and x.ndim == len(size) + 2, "interpolate takes x [N, C, *spatial] and size per spatial dim")
    check(attrs["mode"] in ("nearest", "bilinear"), f"mode must be nearest or bilinear, got {attrs['mode']}")
    return [TensorMeta(tuple(x.shape[:2]) + size, x.dtype)]


def source_scale(n_in, n_out, align_corners):
    if align_corners:
        return (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    return n_in / n_out


def resample_axis(A, x, axis, n_in, n_out, mode, align_corners):
    """Resample one axis: nearest takes floor(dst * in/out); bilinear blends two neighbours."""
    dst = A.read("cast", A.read("iota", n=n_out, axis=0, ndim=1), struct=("f32",))
    scale = A.param(source_scale(n_in, n_out, align_corners) if isinstance(n_in, int) else Sym(f"{n_in}/{n_out}"))
    last = A.param(n_in - 1)
    if mode == "nearest":
        index = A.cmp("min", A.exp("floor", A.mul(dst, scale)), last)
        return A.read("take", x, A.read("cast", index, struct=("i64",)), axis=axis)
    if align_corners:
        src = A.mul(dst, scale)
    else:
        src = A.cmp("max", A.sub(A.mul(A.add(dst, A.lit(0.5)), scale), A.lit(0.5)), A.lit(0))
    lower = A.exp("floor", src)
    frac = A.sub(src, lower)
    i0 = A.read("cast", lower, struct=("i64",))
    i1 = A.read("cast", A.cmp("min", A.add(lower, A.lit(1)), last), struct=("i64",))
    trailing = (n_out,) + (1,) * (-1 - axis)
    w1 = A.read("reshape", frac, shape=trailing)
    w0 = A.read("reshape", A.sub(A.lit(1), frac), shape=trailing)
    return A.add(A.mul(A.read("take", x, i0, axis=axis), w0), A.mul(A.read("take", x, i1, axis=axis), w1))


@op("interpolate", ["x"], interpolate_rule, attrs={"size": (1, 1), "mode": "nearest", "align_corners": False},
    struct={"mode": ("nearest", "bilinear"), "align_corners": (False, True)}, ranks=(4,))
def interpolate(A, x, size, mode, align_corners):
    nd = len(size)
    for i, n_out in enumerate(size):
        axis = i - nd
        x = resample_axis(A, x, axis, A.inputs[0].shape[axis], n_out, mode, align_corners)
    return x

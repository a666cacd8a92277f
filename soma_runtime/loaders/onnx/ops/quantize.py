"""ONNX's linear quantization: DequantizeLinear, QuantizeLinear (per tensor, per axis or per block; round
half to even, saturated to the integer type); the integer products (MatMulInteger, ConvInteger,
QLinearMatMul, QLinearConv) exact in i32, as f32 products over chunks short enough that every sum stays an exact
integer; DynamicQuantizeLinear."""
from __future__ import annotations

import numpy as np

from soma_runtime.dtypes import dtype
from soma_runtime.loaders.onnx.ops.layout import product, reshape_to
from soma_runtime.loaders.onnx.ops.nn import padded, spatial_pads
from soma_runtime.loaders.onnx.ops.table import onnx_op
from soma_runtime.loaders.onnx.reader import dtype_name

EXACT_F32 = 1 << 24                 # integers up to this size are exact in f32


def along(cv, n, param, like):
    """A scale or zero point shaped to broadcast over `like`: a scalar, one per `axis`, or one per block."""
    rank, shape = cv.meta(like).ndim, cv.meta(like).shape
    if cv.meta(param).ndim == 0 or rank == 0:
        return param
    axis = cv.axis(n.attr("axis", 1), rank)
    block = int(n.attr("block_size", 0))
    if block:
        return cv.emit("take", param, np.arange(shape[axis], dtype=np.int64) // block, axis=axis)
    return reshape_to(cv, param, [-1 if i == axis else 1 for i in range(rank)])


def as_f32(cv, x):
    return x if cv.meta(x).dtype == "f32" else cv.emit("cast", x, dtype="f32")


def saturated(cv, x, target: str):
    """x rounded half to even and clipped to `target`'s range, in that type."""
    info = np.iinfo(dtype(target).numpy)
    return cv.emit("cast", cv.emit("clip", cv.emit("round", x), min=float(info.min), max=float(info.max)), dtype=target)


@onnx_op("DequantizeLinear")
def dequantize_linear(cv, n):
    x, scale, zero = n.input(0), n.input(1), n.input(2)
    y = as_f32(cv, x)
    if zero is not None:
        y = cv.emit("sub", y, as_f32(cv, along(cv, n, zero, x)))
    out = dtype_name(n.attr("output_dtype"), cv.where()) if n.attr("output_dtype") else cv.meta(scale).dtype
    y = cv.emit("mul", y, as_f32(cv, along(cv, n, scale, x)))
    return y if out == "f32" else cv.emit("cast", y, dtype=out)


@onnx_op("QuantizeLinear")
def quantize_linear(cv, n):
    x, scale, zero = n.input(0), n.input(1), n.input(2)
    if n.attr("output_dtype"):
        target = dtype_name(n.attr("output_dtype"), cv.where())
    else:
        target = cv.meta(zero).dtype if zero is not None else "u8"
    if dtype(target).numpy.kind not in "iu":
        raise cv.unsupported(f"quantizing to {target}")
    y = cv.emit("div", as_f32(cv, x), as_f32(cv, along(cv, n, scale, x)))
    y = cv.emit("round", y)
    if zero is not None:
        y = cv.emit("add", y, as_f32(cv, along(cv, n, zero, x)))
    return saturated(cv, y, target)


def centered(cv, x, zero):
    """x - zero_point, in f32 (a zero point per row of a, or per column of b, broadcasts so)."""
    y = as_f32(cv, x)
    return y if zero is None else cv.emit("sub", y, as_f32(cv, zero))


def magnitude(cv, x, zero) -> np.ndarray | int:
    """The largest |x - zero| x's type allows (or, x and zero known, the values themselves)."""
    known = zero is None or isinstance(zero, np.ndarray)
    z = zero.astype(np.int64) if isinstance(zero, np.ndarray) else np.int64(0)
    if isinstance(x, np.ndarray) and known:
        return np.abs(x.astype(np.int64) - z)
    info = np.iinfo(dtype(cv.meta(x).dtype).numpy)
    if known:
        return int(np.max(np.maximum(info.max - z, z - info.min)))
    return int(info.max) - int(info.min)


def chunk_length(cv, a, a_zero, b, b_zero, k: int) -> int:
    """The most terms of the inner axis whose sum of |a| * |b| stays an exact f32 integer: from b's values
    where b is known (weights), else from both types' ranges."""
    top = int(np.max(magnitude(cv, a, a_zero), initial=0))
    bound = magnitude(cv, b, b_zero.reshape(-1) if isinstance(b_zero, np.ndarray) and b_zero.ndim == 1 else b_zero)
    if not isinstance(bound, np.ndarray):
        return max(1, (EXACT_F32 - 1) // max(1, top * bound))
    columns = bound.reshape((-1,) + bound.shape[-2:]) * top          # [batch, K, N]
    for parts in range(1, k + 1):
        size = -(-k // parts)
        sums = [columns[:, i:i + size].sum(axis=1).max(initial=0) for i in range(0, k, size)]
        if max(sums) < EXACT_F32:
            return size
    return 1


def integer_product(cv, a, a_zero, b, b_zero):
    """(a - a_zero) @ (b - b_zero) exactly, in i32: f32 products over chunks of the inner axis short enough
    that their sums stay exact integers, each cast to i32 and summed."""
    k = cv.meta(a).shape[-1]
    if not isinstance(k, int):
        raise cv.unsupported(f"an integer product over a symbolic number of terms ({k})")
    if b_zero is not None and cv.meta(b_zero).ndim == 1:
        b_zero = reshape_to(cv, b_zero, (1, -1))
    if a_zero is not None and cv.meta(a_zero).ndim == 1:
        a_zero = reshape_to(cv, a_zero, (-1, 1))
    size = chunk_length(cv, a, a_zero, b, b_zero, k)
    x, w = centered(cv, a, a_zero), centered(cv, b, b_zero)
    if size >= k:
        return cv.emit("cast", cv.emit("matmul", x, w), dtype="i32")
    parts = -(-k // size)
    if parts * size != k:
        x = cv.emit("pad", x, pads=((0, 0),) * (cv.meta(x).ndim - 1) + ((0, parts * size - k),), mode="constant", value=0.0)
        w = cv.emit("pad", w, pads=((0, 0),) * (cv.meta(w).ndim - 2) + ((0, parts * size - k), (0, 0)), mode="constant",
                    value=0.0)
    lead, rows = cv.meta(x).shape[:-2], cv.meta(x).shape[-2]
    x = reshape_to(cv, x, lead + (rows, parts, size))
    x = cv.emit("permute", x, perm=tuple(range(len(lead))) + tuple(len(lead) + i for i in (1, 0, 2)))
    w = reshape_to(cv, w, cv.meta(w).shape[:-2] + (parts, size, cv.meta(w).shape[-1]))
    partial = cv.emit("cast", cv.emit("matmul", x, w), dtype="i32")            # [..., parts, M, N]
    return cv.emit("reduce_sum", partial, axes=(cv.meta(partial).ndim - 3,), keepdims=False)


@onnx_op("MatMulInteger")
def matmul_integer(cv, n):
    a, b = n.inputs[:2]
    return integer_product(cv, a, n.input(2), b, n.input(3))


def requantized(cv, acc, scale, y_zero, target: str):
    """An i32 accumulator to `target`: acc * scale rounded half to even, plus the zero point, saturated."""
    y = cv.emit("round", cv.emit("mul", cv.emit("cast", acc, dtype="f32"), scale))
    if y_zero is not None:
        y = cv.emit("add", y, as_f32(cv, y_zero))
    return saturated(cv, y, target)


@onnx_op("QLinearMatMul")
def qlinear_matmul(cv, n):
    a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero = n.inputs
    acc = integer_product(cv, a, a_zero, b, b_zero)
    scale = cv.emit("div", cv.emit("mul", as_f32(cv, a_scale), as_f32(cv, b_scale)), as_f32(cv, y_scale))
    return requantized(cv, acc, scale, y_zero, cv.meta(y_zero).dtype)


@onnx_op("DynamicQuantizeLinear")
def dynamic_quantize_linear(cv, n):
    return dynamically_quantized(cv, n.inputs[0])


def dynamically_quantized(cv, x):
    """x to u8 over [min(x, 0), max(x, 0)]: scale (max - min) / 255, zero point round(-min / scale) saturated."""
    x = as_f32(cv, x)
    rank = cv.meta(x).ndim
    axes = tuple(range(rank))
    zero = np.array(0.0, np.float32)
    low = cv.emit("minimum", cv.emit("reduce_min", x, axes=axes, keepdims=False) if rank else x, zero)
    high = cv.emit("maximum", cv.emit("reduce_max", x, axes=axes, keepdims=False) if rank else x, zero)
    scale = cv.emit("div", cv.emit("sub", high, low), np.array(255.0, np.float32))
    safe = cv.emit("where", cv.emit("equal", scale, zero), np.array(1.0, np.float32), scale)
    point = saturated(cv, cv.emit("round", cv.emit("div", cv.emit("neg", low), safe)), "u8")
    y = cv.emit("add", cv.emit("round", cv.emit("div", x, safe)), as_f32(cv, point))
    return saturated(cv, y, "u8"), scale, point


def channel_chunk(cv, x, x_zero, w, w_zero) -> int:
    """The most input channels of a group whose products (with the kernel's taps) sum exactly in f32."""
    top = int(np.max(magnitude(cv, x, x_zero), initial=0))
    bound = magnitude(cv, w, w_zero)
    channels = cv.meta(w).shape[1]
    taps = product(cv.meta(w).shape[2:])
    if not isinstance(bound, np.ndarray):
        return max(1, (EXACT_F32 - 1) // max(1, top * bound * taps))
    per_channel = bound.reshape(bound.shape[0], channels, -1).sum(axis=2) * top       # [O, C/groups]
    for size in range(channels, 0, -1):
        if all(per_channel[:, i:i + size].sum(axis=1).max(initial=0) < EXACT_F32 for i in range(0, channels, size)):
            return size
    return 1


def integer_conv(cv, n, x, x_zero, w, w_zero):
    """conv(x - x_zero, w - w_zero) exactly, in i32 (padding reads x's zero point): convolutions over
    chunks of each group's input channels short enough that their sums stay exact f32 integers."""
    kernel = tuple(cv.meta(w).shape[2:])
    nd = len(kernel)
    if nd not in (1, 2):
        raise cv.unsupported(f"a {nd}-D integer convolution")
    strides = tuple(n.attr("strides") or (1,) * nd)
    dilations = tuple(n.attr("dilations") or (1,) * nd)
    groups = int(n.attr("group", 1))
    pads = spatial_pads(cv, n, cv.meta(x).shape[2:], kernel, strides, dilations)
    if w_zero is not None and cv.meta(w_zero).ndim == 1:
        w_zero = reshape_to(cv, w_zero, (-1,) + (1,) * (nd + 1))
    size = channel_chunk(cv, x, x_zero, w, w_zero)
    xc, even = padded(cv, centered(cv, x, x_zero), pads, 0.0)
    wc = centered(cv, w, w_zero)

    def convolved(xs, ws, g):
        y = cv.emit(f"conv{nd}d", xs, ws, None, stride=strides, padding=even, dilation=dilations, groups=g)
        return cv.emit("cast", y, dtype="i32")

    width = cv.meta(w).shape[1]
    if size >= width:
        return convolved(xc, wc, groups)
    outs = cv.meta(w).shape[0] // groups
    results = []
    for g in range(groups):
        total = None
        ws = cv.emit("slice", wc, axis=0, start=g * outs, stop=(g + 1) * outs) if groups > 1 else wc
        for i in range(0, width, size):
            stop = min(i + size, width)
            part = convolved(cv.emit("slice", xc, axis=1, start=g * width + i, stop=g * width + stop),
                             cv.emit("slice", ws, axis=1, start=i, stop=stop), 1)
            total = part if total is None else cv.emit("add", total, part)
        results.append(total)
    return results[0] if groups == 1 else cv.emit("concat", *results, axis=1)


@onnx_op("ConvInteger")
def conv_integer(cv, n):
    return integer_conv(cv, n, n.inputs[0], n.input(2), n.inputs[1], n.input(3))


@onnx_op("QLinearConv")
def qlinear_conv(cv, n):
    x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero = (n.input(i) for i in range(8))
    bias = n.input(8)
    acc = integer_conv(cv, n, x, x_zero, w, w_zero)
    rank = cv.meta(acc).ndim
    if bias is not None:
        acc = cv.emit("add", acc, reshape_to(cv, cv.emit("cast", bias, dtype="i32"), (-1,) + (1,) * (rank - 2)))
    if cv.meta(w_scale).ndim == 1:
        w_scale = reshape_to(cv, w_scale, (-1,) + (1,) * (rank - 2))
    scale = cv.emit("div", cv.emit("mul", as_f32(cv, x_scale), as_f32(cv, w_scale)), as_f32(cv, y_scale))
    target = cv.meta(y_zero).dtype if y_zero is not None else cv.meta(x).dtype
    return requantized(cv, acc, scale, y_zero, target)

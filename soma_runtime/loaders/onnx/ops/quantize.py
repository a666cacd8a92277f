"""ONNX's linear quantization: DequantizeLinear, QuantizeLinear (per tensor, per axis or per block; round
half to even, saturated to the integer type) and the integer products QLinearMatMul and MatMulInteger,
computed in f32 where every integer they sum stays exact."""
from __future__ import annotations

import numpy as np

from soma_runtime.dtypes import dtype
from soma_runtime.loaders.onnx.ops.layout import reshape_to
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


def integer_product(cv, a, a_zero, b, b_zero):
    """(a - a_zero) @ (b - b_zero) in f32, refused where its sums could pass f32's exact integers."""
    k = cv.meta(a).shape[-1]
    if not isinstance(k, int) or k * 255 * 255 >= EXACT_F32:
        raise cv.unsupported(f"an integer product over {k} terms (its sums would not be exact in f32)")
    if b_zero is not None and cv.meta(b_zero).ndim == 1:
        b_zero = reshape_to(cv, b_zero, (1, -1))
    if a_zero is not None and cv.meta(a_zero).ndim == 1:
        a_zero = reshape_to(cv, a_zero, (-1, 1))
    return cv.emit("matmul", centered(cv, a, a_zero), centered(cv, b, b_zero))


@onnx_op("MatMulInteger")
def matmul_integer(cv, n):
    a, b = n.inputs[:2]
    return cv.emit("cast", integer_product(cv, a, n.input(2), b, n.input(3)), dtype="i32")


@onnx_op("QLinearMatMul")
def qlinear_matmul(cv, n):
    a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero = n.inputs
    acc = integer_product(cv, a, a_zero, b, b_zero)
    scale = cv.emit("div", cv.emit("mul", as_f32(cv, a_scale), as_f32(cv, b_scale)), as_f32(cv, y_scale))
    y = cv.emit("add", cv.emit("round", cv.emit("mul", acc, scale)), as_f32(cv, y_zero))
    return saturated(cv, y, cv.meta(y_zero).dtype)

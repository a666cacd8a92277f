"""Resize (and the older Upsample): separable, so each resized axis is one linear map from its input
positions to its output positions, computed here once from the sizes (ONNX's coordinate transforms
and its nearest, linear and cubic kernels, with antialiasing and exclude_outside): a gather where each
output takes one input (nearest), else a product with the [out, in] weights."""
from __future__ import annotations

import math

import numpy as np

from soma_runtime.dtypes import dtype
from soma_runtime.loaders.onnx.ops.table import onnx_op


def source_positions(mode: str, out_size: int, in_size: int, scale: float, roi: tuple | None):
    """Each output index's position in the input (ONNX's coordinate_transformation_mode), and which fall
    outside it (tf_crop_and_resize only: those take the extrapolation value)."""
    y = np.arange(out_size, dtype=np.float64)
    wide = scale * in_size
    outside = None
    if mode == "align_corners":
        x = np.zeros(out_size) if wide == 1 else y * (in_size - 1) / (wide - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_crop_and_resize":
        start, end = roi
        x = np.full(out_size, (end - start) * (in_size - 1) / 2) if wide == 1 else y * (end - start) * (in_size - 1) / (wide - 1)
        x = x + start * (in_size - 1)
        outside = (x < 0) | (x > in_size - 1)
    elif mode == "pytorch_half_pixel":
        x = np.full(out_size, -0.5) if wide == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "half_pixel_symmetric":
        offset = in_size / 2 * (1 - out_size / wide)
        x = offset + (y + 0.5) / scale - 0.5
    else:
        raise ValueError(f"coordinate_transformation_mode {mode!r}")
    return x, outside


def nearest_coeffs(ratio: float, scale: float, rounding: str) -> np.ndarray:
    if float(ratio).is_integer():
        return np.array([0.0, 1.0])
    pick_right = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5, "floor": False, "ceil": True}[rounding]
    return np.array([0.0, 1.0]) if pick_right else np.array([1.0, 0.0])


def linear_coeffs(ratio: float, scale: float, antialias: bool) -> np.ndarray:
    if not antialias:
        return np.array([1 - ratio, ratio])
    scale = min(scale, 1.0)
    start = int(np.floor(-1 / scale) + 1)
    coeffs = np.clip(1 - np.abs((np.arange(start, 2 - start) - ratio) * scale), 0, 1)
    return coeffs / coeffs.sum()


def cubic_coeffs(ratio: float, scale: float, a: float, antialias: bool) -> np.ndarray:
    def kernel(x):
        x = abs(x)
        if x <= 1:
            return (a + 2) * x ** 3 - (a + 3) * x ** 2 + 1
        return a * x ** 3 - 5 * a * x ** 2 + 8 * a * x - 4 * a if x < 2 else 0.0
    if not antialias:
        return np.array([kernel(1 + ratio), kernel(ratio), kernel(1 - ratio), kernel(2 - ratio)])
    scale = min(scale, 1.0)
    start = int(np.floor(-2 / scale) + 1)
    coeffs = np.array([kernel(scale * (i - ratio)) for i in range(start, 2 - start)])
    return coeffs / coeffs.sum()


def axis_weights(x: np.ndarray, in_size: int, scale: float, coeffs_of, exclude_outside: bool) -> np.ndarray:
    """The [out, in] map: each output's coefficients over its nearest input neighbours, the neighbours
    past an edge clamped to it (or, with exclude_outside, dropped and the rest renormalized)."""
    base = np.floor(x).astype(np.int64)
    ratios = np.where(x == base, 1.0, x - base)
    weights = np.zeros((len(x), in_size))
    for row, (position, ratio) in enumerate(zip(x, ratios)):
        coeffs = coeffs_of(float(ratio), scale)
        n = len(coeffs)
        pad = math.ceil(n / 2)
        start = math.floor(position + pad)
        frac = position + pad - start
        if n % 2 == 0:
            start += -(n // 2) if frac == 0 else -(n // 2) + 1
        else:
            start += -((n - 1) // 2) + (0 if frac <= 0.5 else 1)
        neighbours = start + np.arange(n) - pad
        if exclude_outside:
            coeffs = np.where((neighbours < 0) | (neighbours >= in_size), 0.0, coeffs)
            coeffs = coeffs / (coeffs.sum() or 1.0)
        np.add.at(weights[row], np.clip(neighbours, 0, in_size - 1), coeffs)
    return weights


def resized_axis(cv, x, axis: int, weights: np.ndarray, outside, fill: float, nearest: bool):
    rank = cv.meta(x).ndim
    if nearest and outside is None:
        return cv.emit("take", x, np.argmax(weights, axis=1).astype(np.int64), axis=axis)
    perm = [i for i in range(rank) if i != axis] + [axis]
    moved = cv.emit("permute", x, perm=tuple(perm))
    y = cv.emit("matmul", moved, weights.astype(dtype(cv.meta(x).dtype).numpy), transpose_b=True)
    if outside is not None and outside.any():
        y = cv.emit("where", outside, np.array(fill, dtype(cv.meta(x).dtype).numpy), y)
    return cv.emit("permute", y, perm=tuple(int(i) for i in np.argsort(perm)))


def resize(cv, n, x, scales, sizes, roi):
    dims = cv.meta(x).shape
    rank = len(dims)
    if not all(isinstance(d, int) for d in dims):
        raise cv.unsupported(f"resizing symbolic sizes {list(dims)}")
    axes = [a % rank for a in (n.attr("axes") or range(rank))]
    mode = n.attr("mode", "nearest")
    transform = n.attr("coordinate_transformation_mode", "half_pixel" if n.opset >= 11 else "asymmetric")
    antialias = bool(n.attr("antialias", 0)) and mode != "nearest"
    rounding = n.attr("nearest_mode", "floor" if n.op_type == "Upsample" else "round_prefer_floor")
    coeffs_of = {"nearest": lambda r, s: nearest_coeffs(r, s, rounding),
                 "linear": lambda r, s: linear_coeffs(r, s, antialias),
                 "cubic": lambda r, s: cubic_coeffs(r, s, n.attr("cubic_coeff_a", -0.75), antialias)}.get(mode)
    if coeffs_of is None:
        raise cv.unsupported(f"resize mode {mode!r}")
    if sizes is not None:
        out = dict(zip(axes, sizes))
        factor = {a: out[a] / dims[a] for a in axes}
        policy = n.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            scale = (min if policy == "not_larger" else max)(factor.values())
            factor = {a: scale for a in axes}
            out = {a: int(scale * dims[a] + 0.5) for a in axes}
    else:
        factor = dict(zip(axes, scales))
        out = {a: int(factor[a] * dims[a]) for a in axes}
    float_x = cv.meta(x).dtype in ("f32", "f16", "bf16", "f64")
    y = x if float_x or mode == "nearest" else cv.emit("cast", x, dtype="f32")
    for axis in axes:
        region = None if roi is None else (roi[axes.index(axis)], roi[len(axes) + axes.index(axis)])
        unchanged = math.isclose(factor[axis], 1.0) and out[axis] == dims[axis] and \
            (region is None or (math.isclose(region[0], 0.0) and math.isclose(region[1], 1.0)))
        if unchanged:
            continue
        positions, outside = source_positions(transform, out[axis], dims[axis], factor[axis], region)
        weights = axis_weights(positions, dims[axis], factor[axis], coeffs_of, bool(n.attr("exclude_outside", 0)))
        y = resized_axis(cv, y, axis, weights, outside, n.attr("extrapolation_value", 0.0), mode == "nearest")
    if y is not x and cv.meta(y).dtype != cv.meta(x).dtype:
        info = np.iinfo(dtype(cv.meta(x).dtype).numpy)
        y = cv.emit("cast", cv.emit("clip", y, min=float(info.min), max=float(info.max)), dtype=cv.meta(x).dtype)
    return y


def floats(cv, x, what):
    value = cv.known(x, what)
    return None if value is None or value.size == 0 else [float(v) for v in value.reshape(-1)]


@onnx_op("Resize")
def resize_op(cv, n):
    x = n.inputs[0]
    if n.opset < 11:
        return resize(cv, n, x, floats(cv, n.input(1), "scales"), None, None)
    roi, scales, sizes = floats(cv, n.input(1), "roi"), floats(cv, n.input(2), "scales"), cv.ints(n.input(3), "sizes")
    if n.attr("coordinate_transformation_mode") != "tf_crop_and_resize":
        roi = None
    return resize(cv, n, x, scales, sizes or None, roi)


@onnx_op("Upsample")
def upsample(cv, n):
    scales = n.attr("scales") if n.opset < 9 else floats(cv, n.inputs[1], "scales")
    return resize(cv, n, n.inputs[0], scales, None, None)

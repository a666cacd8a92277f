"""Resampling. Resize (and the older Upsample) is separable, so each resized axis is one linear map from
its input positions to its output positions, computed here once from the sizes (ONNX's coordinate
transforms and its nearest, linear and cubic kernels, with antialiasing and exclude_outside): a gather
where each output takes one input (nearest), else a weighted sum of a gather per tap. GridSample's
positions come with the data: its taps' indices and weights are computed in the graph."""
from __future__ import annotations

import itertools
import math

import numpy as np

from soma_runtime.dtypes import dtype
from soma_runtime.loaders.onnx.fold import SymbolicError
from soma_runtime.loaders.onnx.ops.layout import reshape_to
from soma_runtime.loaders.onnx.ops.table import onnx_op

MAX_RESIZED = 1 << 16            # positions along one resized axis (their taps are found one by one at load)
MAX_TAPS = 256                   # inputs one output weighs (an antialiased shrink by ~100x, linear, takes 200)


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


def axis_taps(x: np.ndarray, in_size: int, scale: float, coeffs_of, exclude_outside: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each output's taps, [out, n]: the input positions its coefficients weigh (its nearest neighbours,
    clamped to the edges) and those coefficients (with exclude_outside, 0 past an edge, the rest
    renormalized)."""
    base = np.floor(x).astype(np.int64)
    ratios = np.where(x == base, 1.0, x - base)
    positions, weights = [], []
    for position, ratio in zip(x, ratios):
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
        positions.append(np.clip(neighbours, 0, in_size - 1))
        weights.append(coeffs)
    if not positions:
        return np.zeros((0, 1), np.int64), np.zeros((0, 1))
    return np.stack(positions), np.stack(weights)


def resized_axis(cv, x, axis: int, taps: tuple[np.ndarray, np.ndarray], outside, fill: float, nearest: bool):
    """Each output along `axis` as the sum of its taps, each an input weighed by its coefficient, as ONNX
    defines it (a product with a dense [out, in] map would carry an infinity or a NaN to every output)."""
    positions, weights = taps
    if nearest and outside is None:
        return cv.emit("take", x, positions[np.arange(len(positions)), np.argmax(weights, axis=1)], axis=axis)
    np_dtype = dtype(cv.meta(x).dtype).numpy
    along = [len(weights) if i == axis else 1 for i in range(cv.meta(x).ndim)]
    y = None
    for k in range(positions.shape[1]):
        tap = cv.emit("mul", cv.emit("take", x, positions[:, k], axis=axis), weights[:, k].reshape(along).astype(np_dtype))
        y = tap if y is None else cv.emit("add", y, tap)
    if outside is not None and outside.any():
        y = cv.emit("where", outside.reshape(along), np.array(fill, np_dtype), y)
    return y


def resize(cv, n, x, scales, sizes, roi):
    dims = cv.meta(x).shape
    rank = len(dims)
    if not all(isinstance(d, int) for d in dims):
        raise SymbolicError(f"resizing symbolic sizes {list(dims)}")
    axes = [cv.axis(a, rank) for a in (n.attr("axes") or range(rank))]
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
    for axis in axes:
        if not 0 <= out[axis] <= MAX_RESIZED:
            raise cv.unsupported(f"resizing axis {axis} from {dims[axis]} to {out[axis]} (at most {MAX_RESIZED} "
                                 f"are supported)")
    float_x = cv.meta(x).dtype in ("f32", "f16", "bf16", "f64")
    y = x if float_x or mode == "nearest" else cv.emit("cast", x, dtype="f32")
    for axis in axes:
        region = None if roi is None else (roi[axes.index(axis)], roi[len(axes) + axes.index(axis)])
        unchanged = math.isclose(factor[axis], 1.0) and out[axis] == dims[axis] and \
            (region is None or (math.isclose(region[0], 0.0) and math.isclose(region[1], 1.0)))
        if unchanged:
            continue
        positions, outside = source_positions(transform, out[axis], dims[axis], factor[axis], region)
        taps = axis_taps(positions, dims[axis], factor[axis], coeffs_of, bool(n.attr("exclude_outside", 0)))
        if taps[0].shape[1] > MAX_TAPS:
            raise cv.unsupported(f"resizing axis {axis} from {dims[axis]} to {out[axis]} takes {taps[0].shape[1]} "
                                 f"inputs an output (at most {MAX_TAPS} are supported)")
        y = resized_axis(cv, y, axis, taps, outside, n.attr("extrapolation_value", 0.0), mode == "nearest")
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
    if n.opset < 7:
        raise cv.unsupported("the experimental Upsample of opset 1 (height_scale, width_scale) is not supported")
    scales = n.attr("scales") if n.opset < 9 else floats(cv, n.inputs[1], "scales")
    return resize(cv, n, n.inputs[0], scales, None, None)


# --- GridSample: each output samples the input where its grid point falls, computed as the model runs ---

def cubic_weights(cv, f):
    """Keys' cubic convolution (a = -0.75) at the four taps around a point f past the first of the middle two."""
    a = -0.75

    def near(t):                           # |t| <= 1
        return cv.emit("add", cv.emit("mul", cv.emit("mul", t, t), cv.emit("sub", cv.emit("mul", t, scalar(cv, a + 2, t)),
                                                                            scalar(cv, a + 3, t))), scalar(cv, 1, t))

    def far(t):                            # 1 < |t| < 2
        inner = cv.emit("add", cv.emit("mul", cv.emit("sub", cv.emit("mul", t, scalar(cv, a, t)), scalar(cv, 5 * a, t)), t),
                        scalar(cv, 8 * a, t))
        return cv.emit("sub", cv.emit("mul", inner, t), scalar(cv, 4 * a, t))
    one, two = scalar(cv, 1, f), scalar(cv, 2, f)
    return [far(cv.emit("add", f, one)), near(f), near(cv.emit("sub", one, f)), far(cv.emit("sub", two, f))]


def scalar(cv, value, like):
    return np.array(value, dtype(cv.meta(like).dtype).numpy)


def reflected(cv, v, low: float, high: float):
    """v folded back into [low, high] by reflecting off the near border as often as it takes."""
    span = scalar(cv, high - low, v)

    def fold(dx, near, far):
        """dx past the `near` border: an even number of spans back from it, an odd one from the `far` one."""
        turns = cv.emit("floor", cv.emit("div", dx, span))
        rest = cv.emit("sub", dx, cv.emit("mul", turns, span))
        odd = cv.emit("equal", cv.emit("mod", turns, scalar(cv, 2, v), fmod=True), scalar(cv, 1, v))
        inward = 1 if near == low else -1
        return cv.emit("where", odd, cv.emit("add", scalar(cv, far, v), cv.emit("mul", rest, scalar(cv, -inward, v))),
                       cv.emit("add", scalar(cv, near, v), cv.emit("mul", rest, scalar(cv, inward, v))))
    below = fold(cv.emit("sub", scalar(cv, low, v), v), low, high)
    above = fold(cv.emit("sub", v, scalar(cv, high, v)), high, low)
    inside = cv.emit("where", cv.emit("greater", v, scalar(cv, high, v)), above, v)
    return cv.emit("where", cv.emit("less", v, scalar(cv, low, v)), below, inside)


def truncated(cv, v):
    return cv.emit("where", cv.emit("less", v, scalar(cv, 0, v)), cv.emit("ceil", v), cv.emit("floor", v))


@onnx_op("GridSample")
def grid_sample(cv, n):
    x, grid = n.inputs
    sizes, out = cv.meta(x).shape[2:], cv.meta(grid).shape[1:-1]
    batch, channels = cv.meta(x).shape[:2]
    if not all(isinstance(d, int) for d in (*sizes, *out, batch, channels)):
        raise SymbolicError("GridSample over symbolic sizes")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(n.attr("mode", "linear"), n.attr("mode", "linear"))
    padding, aligned = n.attr("padding_mode", "zeros"), bool(n.attr("align_corners", 0))
    if mode not in ("nearest", "linear", "cubic"):
        raise cv.unsupported(f"GridSample mode {mode!r}")
    d = len(sizes)
    taps_per_axis = []                                   # per spatial axis: [(index, weight)] at each tap
    for axis, size in enumerate(sizes):
        c = cv.emit("take", grid, np.array(d - 1 - axis, np.int64), axis=-1)     # the grid's last component is x
        one = scalar(cv, 1, c)
        c = (cv.emit("mul", cv.emit("mul", cv.emit("add", c, one), scalar(cv, 0.5, c)), scalar(cv, size - 1, c)) if aligned else
             cv.emit("mul", cv.emit("sub", cv.emit("mul", cv.emit("add", c, one), scalar(cv, size, c)), one), scalar(cv, 0.5, c)))
        if mode == "nearest":
            c = cv.emit("round", c)
        low, high = (0.0, size - 1.0) if aligned else (-0.5, size - 0.5)
        if padding == "border":
            c = cv.emit("clip", c, min=0.0, max=float(size - 1))
        elif padding == "reflection":
            c = reflected(cv, c, low, high)
        if mode == "nearest":
            taps_per_axis.append([(c, None)])
            continue
        base = cv.emit("floor", c)
        f = cv.emit("sub", c, base)
        weights = [cv.emit("sub", one, f), f] if mode == "linear" else cubic_weights(cv, f)
        first = 0 if mode == "linear" else -1
        taps_per_axis.append([(cv.emit("add", base, scalar(cv, first + i, c)), w) for i, w in enumerate(weights)])
    rows = reshape_to(cv, x, (batch, channels, int(np.prod(sizes))))
    strides = [int(np.prod(sizes[i + 1:])) for i in range(d)]
    total = None
    for combo in itertools.product(*taps_per_axis):
        flat, weight, valid = None, None, None
        for axis, (index, w) in enumerate(combo):
            size = sizes[axis]
            if padding == "reflection" and mode != "nearest":
                index = truncated(cv, reflected(cv, index, *((0.0, size - 1.0) if aligned else (-0.5, size - 0.5))))
            inside = cv.emit("logical_and", cv.emit("greater_equal", index, scalar(cv, 0, index)),
                             cv.emit("less", index, scalar(cv, size, index)))
            valid = inside if valid is None else cv.emit("logical_and", valid, inside)
            index = cv.emit("cast", cv.emit("clip", index, min=0.0, max=float(size - 1)), dtype="i64")
            term = cv.emit("mul", index, np.array(strides[axis], np.int64))
            flat = term if flat is None else cv.emit("add", flat, term)
            weight = w if weight is None else (weight if w is None else cv.emit("mul", weight, w))
        flat = cv.emit("expand", reshape_to(cv, flat, (batch, 1, int(np.prod(out)))), shape=(batch, channels, int(np.prod(out))))
        sample = cv.emit("gather", rows, flat, axis=2)
        factor = cv.emit("cast", valid, dtype=cv.meta(x).dtype) if padding == "zeros" else None
        if weight is not None:
            factor = weight if factor is None else cv.emit("mul", factor, weight)
        if factor is not None:
            sample = cv.emit("mul", sample, reshape_to(cv, factor, (batch, 1, int(np.prod(out)))))
        total = sample if total is None else cv.emit("add", total, sample)
    return reshape_to(cv, total, (batch, channels, *out))

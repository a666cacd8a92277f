"""ONNX's network layers: MatMul and Gemm, convolutions and pools, the norms, softmax."""
from __future__ import annotations

import itertools
import math

import numpy as np

from soma_runtime.dtypes import FLOATS, dtype, lowest
from soma_runtime.loaders.onnx.fold import SymbolicError
from soma_runtime.loaders.onnx.ops.elementwise import scalar
from soma_runtime.loaders.onnx.ops.layout import product, reshape_to
from soma_runtime.loaders.onnx.ops.table import onnx_op


def matrix_product(cv, a, b, transposed: bool):
    """a @ b (b.T when `transposed`); a known 2-D b is stored [N, K] as the IR's linear layers' weights are,
    so the fuse pass folds its bias, activation and residual in."""
    if isinstance(b, np.ndarray) and b.ndim == 2 and b.dtype.kind == "f" and not transposed:
        b, transposed = np.ascontiguousarray(b.T), True
    return cv.emit("matmul", a, b, transpose_b=transposed)


@onnx_op("MatMul")
def matmul(cv, n):
    a, b = n.inputs
    ra, rb = cv.meta(a).ndim, cv.meta(b).ndim
    if ra == 1:
        a = reshape_to(cv, a, (1,) + cv.meta(a).shape)
    if rb == 1:
        b = reshape_to(cv, b, cv.meta(b).shape + (1,))
    y = matrix_product(cv, a, b, transposed=False)
    dims = cv.meta(y).shape
    if ra == 1 or rb == 1:
        y = reshape_to(cv, y, dims[:-2] + (() if ra == 1 else dims[-2:-1]) + (() if rb == 1 else dims[-1:]))
    return y


@onnx_op("Gemm")
def gemm(cv, n):
    a, b, c = n.input(0), n.input(1), n.input(2)
    if n.attr("transA", 0):
        a = cv.emit("permute", a, perm=(1, 0))
    y = matrix_product(cv, a, b, transposed=bool(n.attr("transB", 0)))
    alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
    if alpha != 1.0:
        y = cv.emit("mul", y, scalar(cv, alpha, y))
    if c is not None and beta != 0.0:
        y = cv.emit("add", y, c if beta == 1.0 else cv.emit("mul", c, scalar(cv, beta, c)))
    return y


# --- convolutions and pools --------------------------------------------------------------------

def spatial_pads(cv, n, sizes, kernel, strides, dilations) -> list[tuple[int, int]]:
    """(before, after) per spatial axis, from `pads` or `auto_pad`."""
    auto = n.attr("auto_pad", "NOTSET")
    nd = len(kernel)
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        if not all(isinstance(s, int) for s in sizes):
            raise SymbolicError("auto_pad on symbolic sizes")
        pads = []
        for size, k, s, d in zip(sizes, kernel, strides, dilations):
            total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
            small, big = total // 2, total - total // 2
            pads.append((small, big) if auto == "SAME_UPPER" else (big, small))
        return pads
    if auto == "VALID":
        return [(0, 0)] * nd
    pads = n.attr("pads") or [0] * (2 * nd)
    return list(zip(pads[:nd], pads[nd:]))


def padded(cv, x, pads, value):
    """x with uneven spatial pads applied (the IR's conv and pool pad evenly); the even part left to them."""
    even = [min(b, e) for b, e in pads]
    if all(b == e for b, e in pads):
        return x, tuple(even)
    rank = cv.meta(x).ndim
    widths = ((0, 0),) * (rank - len(pads)) + tuple((b - m, e - m) for (b, e), m in zip(pads, even))
    return cv.emit("pad", x, pads=widths, mode="constant", value=value), tuple(even)


@onnx_op("Conv")
def conv(cv, n):
    x, w, bias = n.input(0), n.input(1), n.input(2)
    kernel = tuple(cv.meta(w).shape[2:])
    nd = len(kernel)
    if nd not in (1, 2):
        raise cv.unsupported(f"a {nd}-D convolution")
    if tuple(n.attr("kernel_shape", kernel)) != kernel:
        raise cv.invalid(f"kernel_shape {list(n.attr('kernel_shape'))} is not its weights' {list(kernel)}")
    strides = tuple(n.attr("strides") or (1,) * nd)
    dilations = tuple(n.attr("dilations") or (1,) * nd)
    pads = spatial_pads(cv, n, cv.meta(x).shape[2:], kernel, strides, dilations)
    x, even = padded(cv, x, pads, 0.0)
    return cv.emit(f"conv{nd}d", x, w, bias, stride=strides, padding=even, dilation=dilations,
                   groups=int(n.attr("group", 1)))


def diagonal(cv, x, letters: str) -> tuple[object, str]:
    """An operand with a repeated letter (ii) reduced to its diagonal, the letter kept once."""
    while len(set(letters)) < len(letters):
        letter = next(c for c in letters if letters.count(c) > 1)
        first, second = letters.index(letter), letters.index(letter, letters.index(letter) + 1)
        size = cv.meta(x).shape[first]
        rest = [i for i in range(len(letters)) if i not in (first, second)]
        x = cv.emit("permute", x, perm=tuple(rest + [first, second]))
        dims = cv.meta(x).shape
        flat = reshape_to(cv, x, tuple(dims[:-2]) + (size * size,))
        x = cv.emit("slice", flat, axis=len(dims) - 2, start=0, stop=size * size, step=size + 1)
        letters = "".join(letters[i] for i in rest) + letter
    return x, letters


@onnx_op("Einsum")
def einsum(cv, n):
    """Each operand's axes laid out in one order of all the equation's letters (size 1 where it lacks
    one), the operands multiplied, the letters the output lacks summed away."""
    equation = n.attr("equation").replace(" ", "")
    given, _, wanted = equation.partition("->")
    terms = given.split(",")
    spare = iter("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    ellipsis = ""
    operands = []
    for term, x in zip(terms, n.inputs):
        if "..." in term:
            extra = cv.meta(x).ndim - len(term.replace("...", ""))
            ellipsis += "".join(next(spare) for _ in range(extra - len(ellipsis)))      # the longest ... seen
            term = term.replace("...", ellipsis[len(ellipsis) - extra:])
        operands.append(diagonal(cv, x, term))
    if "->" not in equation:
        counts = "".join(t for _, t in operands)
        wanted = ellipsis + "".join(sorted(c for c in set(counts) if counts.count(c) == 1 and c not in ellipsis))
    wanted = wanted.replace("...", ellipsis)
    order = wanted + "".join(sorted({c for _, t in operands for c in t} - set(wanted)))
    total = None
    for x, term in operands:
        x = cv.emit("permute", x, perm=tuple(term.index(c) for c in order if c in term))
        dims = iter(cv.meta(x).shape)
        x = reshape_to(cv, x, tuple(next(dims) if c in term else 1 for c in order))
        total = x if total is None else cv.emit("mul", total, x)
    summed = tuple(range(len(wanted), len(order)))
    return cv.emit("reduce_sum", total, axes=summed, keepdims=False) if summed else total


@onnx_op("ConvTranspose")
def conv_transpose(cv, n):
    """The IR's transposed convolution, its crop the `pads` less the `output_padding` (a negative crop
    extends); pads past the kernel's span are sliced off after it."""
    x, w, bias = n.input(0), n.input(1), n.input(2)
    kernel = tuple(cv.meta(w).shape[2:])
    nd, groups = len(kernel), int(n.attr("group", 1))
    if nd not in (1, 2, 3):
        raise cv.unsupported(f"a {nd}-D transposed convolution")
    sizes = cv.meta(x).shape[2:]
    strides = tuple(n.attr("strides") or (1,) * nd)
    dilations = tuple(n.attr("dilations") or (1,) * nd)
    extra = tuple(n.attr("output_padding") or (0,) * nd)
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    wanted, auto = n.attr("output_shape"), n.attr("auto_pad", "NOTSET")
    if wanted or auto in ("SAME_UPPER", "SAME_LOWER"):
        if not all(isinstance(s, int) for s in sizes):
            raise SymbolicError(f"an output shape fitted to symbolic sizes {list(sizes)}")
        full = [s * (size - 1) + e + span for size, s, e, span in zip(sizes, strides, extra, spans)]
        wanted = list(wanted)[-nd:] if wanted else [size * s for size, s in zip(sizes, strides)]
        totals = [f - o for f, o in zip(full, wanted)]
        extra = tuple(e + max(0, -t) for e, t in zip(extra, totals))       # a longer output than the input makes
        totals = [max(0, t) for t in totals]                               # is more output padding
        pads = [(t // 2, t - t // 2) if auto != "SAME_LOWER" else (t - t // 2, t // 2) for t in totals]
    elif auto == "VALID":
        pads = [(0, 0)] * nd
    else:
        flat = n.attr("pads") or [0] * (2 * nd)
        pads = list(zip(flat[:nd], flat[nd:]))
    crops = [(b, e - x_) for (b, e), x_ in zip(pads, extra)]
    within = tuple((min(b, span - 1), min(e, span - 1)) for (b, e), span in zip(crops, spans))
    y = cv.emit(f"conv_transpose{nd}d", x, w, bias, stride=strides, dilation=dilations, groups=groups, crop=within)
    for axis, ((b, e), (wb, we)) in enumerate(zip(crops, within)):
        if b > wb or e > we:
            y = cv.emit("slice", y, axis=2 + axis, start=b - wb, stop=cv.meta(y).shape[2 + axis] - (e - we))
    return y


@onnx_op("Col2Im")
def col2im(cv, n):
    """Blocks (columns of C x kernel values) summed back into the image they were read from: a transposed
    convolution, per channel, of the blocks' grid with one-hot kernels (block value k lands at offset k)."""
    x = n.inputs[0]
    image, kernel = cv.ints(n.inputs[1], "image shape"), cv.ints(n.inputs[2], "block shape")
    nd = len(kernel)
    if nd not in (1, 2, 3):
        raise cv.unsupported(f"a {nd}-D image")
    strides, dilations = n.attr("strides") or [1] * nd, n.attr("dilations") or [1] * nd
    pads = n.attr("pads") or [0] * (2 * nd)
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    grid = [(size + pads[a] + pads[nd + a] - span) // s + 1 for a, (size, span, s) in enumerate(zip(image, spans, strides))]
    batch, columns = cv.meta(x).shape[:2]
    blocks = product(kernel)
    channels = columns // blocks
    one_hot = np.eye(blocks, dtype=dtype(cv.meta(x).dtype).numpy).reshape(blocks, 1, *kernel)
    one_hot = np.tile(one_hot, (channels,) + (1,) * (nd + 1))
    full = [s * (g - 1) + span for g, s, span in zip(grid, strides, spans)]
    crop = tuple((pads[a], full[a] - pads[a] - image[a]) for a in range(nd))
    return cv.emit(f"conv_transpose{nd}d", reshape_to(cv, x, (batch, columns, *grid)), one_hot, None, stride=tuple(strides),
                   dilation=tuple(dilations), groups=channels, crop=crop)


@onnx_op("LRN")
def lrn(cv, n):
    """Local response normalization: x / (bias + alpha / size * the sum of squares over `size` neighbouring
    channels) ** beta, the window's sum as that many slices of the zero-padded squares added."""
    x = n.inputs[0]
    size = int(n.attr("size"))
    rank, channels = cv.meta(x).ndim, cv.meta(x).shape[1]
    squares = cv.emit("mul", x, x)
    pads = ((0, 0), ((size - 1) // 2, size // 2)) + ((0, 0),) * (rank - 2)
    padded = cv.emit("pad", squares, pads=pads, mode="constant", value=0.0)
    total = cv.emit("slice", padded, axis=1, start=0, stop=channels)
    for k in range(1, size):
        total = cv.emit("add", total, cv.emit("slice", padded, axis=1, start=k, stop=channels + k))
    scale = cv.emit("add", scalar(cv, n.attr("bias", 1.0), x), cv.emit("mul", total, scalar(cv, n.attr("alpha", 1e-4) / size, x)))
    return cv.emit("div", x, cv.emit("pow", scale, scalar(cv, n.attr("beta", 0.75), x)))


def pool_windows(size: int, k: int, s: int, d: int, pads: tuple[int, int], ceil: bool) -> tuple[int, int]:
    """Output length along one axis, and the padding past `pads` its last window needs (ceil mode)."""
    span, total = (k - 1) * d + 1, size + pads[0] + pads[1]
    out = (-(-(total - span) // s) if ceil else (total - span) // s) + 1
    if ceil and (out - 1) * s >= size + pads[0]:        # a last window starting in the end padding is dropped
        out -= 1
    return out, max(0, (out - 1) * s + span - total)


def pooled_by_offsets(cv, n, x, kernel, strides, dilations, pads):
    """A pool of any rank, dilation and ceil mode (and LpPool): each kernel offset a strided slice of the
    padded input, combined by max or sum; the averages' divisors counted the same way at load time."""
    sizes = cv.meta(x).shape[2:]
    if not all(isinstance(s, int) for s in sizes):
        raise SymbolicError(f"pooling symbolic sizes {list(sizes)} with dilations, ceil mode or p-norms")
    kind = n.op_type
    ceil = bool(n.attr("ceil_mode", 0))
    windows = [pool_windows(*args, ceil) for args in zip(sizes, kernel, strides, dilations, pads)]
    widths = ((0, 0), (0, 0)) + tuple((b, e + extra) for (b, e), (_, extra) in zip(pads, windows))
    p = int(n.attr("p", 2))
    if kind == "LpPool":
        x = cv.emit("abs", x) if p == 1 else cv.emit("mul", x, x) if p == 2 else \
            cv.emit("pow", cv.emit("abs", x), scalar(cv, p, x))
    lowest_value = lowest(dtype(cv.meta(x).dtype).numpy)
    x = cv.emit("pad", x, pads=widths, mode="constant", value=float(lowest_value) if kind == "MaxPool" else 0.0)

    def offsets(tensor, combine):
        total = None
        for offset in itertools.product(*(range(k) for k in kernel)):
            part = tensor
            for axis, (j, d, s, (out, _)) in enumerate(zip(offset, dilations, strides, windows)):
                part = cv.emit("slice", part, axis=2 + axis, start=j * d, stop=j * d + (out - 1) * s + 1, step=s)
            total = part if total is None else combine(total, part)
        return total
    if kind == "MaxPool" and n.n_outputs > 1:
        return max_with_indices(cv, n, x, kernel, strides, dilations, pads, [out for out, _ in windows], sizes)
    if kind == "MaxPool":
        return offsets(x, lambda a, b: cv.emit("maximum", a, b))
    total = offsets(x, lambda a, b: cv.emit("add", a, b))
    if kind == "LpPool":
        return cv.emit("sqrt", total) if p == 2 else total if p == 1 else cv.emit("pow", total, scalar(cv, 1 / p, total))
    counted = np.ones((1, 1) + tuple(sizes))              # the positions a window's average divides by
    if n.attr("count_include_pad", 0):                    # the explicit pads count, a ceil mode's extra does not
        counted = np.pad(counted, ((0, 0), (0, 0)) + tuple(pads), constant_values=1)
        counted = np.pad(counted, ((0, 0), (0, 0)) + tuple((0, extra) for _, extra in windows))
    else:
        counted = np.pad(counted, widths)
    divisor = np.zeros([1, 1] + [out for out, _ in windows])
    for offset in itertools.product(*(range(k) for k in kernel)):
        divisor += counted[(slice(None), slice(None)) + tuple(slice(j * d, j * d + (out - 1) * s + 1, s) for j, d, s, (out, _)
                                                              in zip(offset, dilations, strides, windows))]
    return cv.emit("div", total, divisor.astype(dtype(cv.meta(total).dtype).numpy))


def max_with_indices(cv, n, x, kernel, strides, dilations, pads, outs, sizes):
    """MaxPool's values and where each came from: the kernel offsets in order, each taking a position where it
    is strictly larger (the first largest wins), the positions flattened over the unpadded input (row-major,
    or its spatial axes column-major with storage_order 1)."""
    batch, channels = cv.meta(x).shape[:2]
    if not all(isinstance(d, int) for d in (batch, channels)):
        raise SymbolicError("MaxPool's indices over symbolic sizes")
    order = list(range(len(sizes)))[::-1] if n.attr("storage_order", 0) else list(range(len(sizes)))
    strides_of = {axis: math.prod(sizes[a] for a in order[order.index(axis) + 1:]) for axis in order}
    plane = np.arange(batch * channels, dtype=np.int64).reshape(batch, channels, *[1] * len(sizes)) * math.prod(sizes)
    best = at = None
    for offset in itertools.product(*(range(k) for k in kernel)):
        part, where = x, plane
        for axis, (j, d, s, out, (before, _)) in enumerate(zip(offset, dilations, strides, outs, pads)):
            part = cv.emit("slice", part, axis=2 + axis, start=j * d, stop=j * d + (out - 1) * s + 1, step=s)
            position = np.arange(out, dtype=np.int64) * s + j * d - before
            where = where + position.reshape([-1 if i == axis else 1 for i in range(len(sizes))]) * strides_of[axis]
        if best is None:
            best, at = part, np.broadcast_to(where, (batch, channels, *outs)).copy()
            continue
        larger = cv.emit("greater", part, best)
        best, at = cv.emit("where", larger, part, best), cv.emit("where", larger, where, at)
    return best, at


@onnx_op("MaxUnpool")
def max_unpool(cv, n):
    """Each value written at the position its index names in an output of zeros: the pool's inverse shape,
    the index flat over it; a given output shape holds that one, padded at the ends (indices re-flattened)."""
    x, index = n.inputs[0], n.inputs[1]
    kernel = tuple(n.attr("kernel_shape"))
    nd = len(kernel)
    strides = n.attr("strides") or [1] * nd
    pads = n.attr("pads") or [0] * (2 * nd)
    dims = cv.meta(x).shape
    inverse = [*dims[:2], *((size - 1) * s - pads[a] - pads[nd + a] + k
                            for a, (size, s, k) in enumerate(zip(dims[2:], strides, kernel)))]
    shape = cv.ints(n.input(2), "output shape") or inverse
    if list(shape) != inverse:
        index, flat = cv.emit("cast", index, dtype="i64"), None
        for axis in range(len(inverse)):
            within = math.prod(inverse[axis + 1:])
            coordinate = cv.emit("mod", cv.emit("div", index, np.array(within, np.int64)), np.array(inverse[axis], np.int64))
            flat = coordinate if flat is None else \
                cv.emit("add", cv.emit("mul", flat, np.array(shape[axis], np.int64)), coordinate)
        index = flat
    zeros = np.zeros(math.prod(shape), dtype(cv.meta(x).dtype).numpy)
    written = cv.emit("scatter", zeros, reshape_to(cv, index, (-1,)), reshape_to(cv, x, (-1,)), axis=0)
    return reshape_to(cv, written, tuple(shape))


@onnx_op("LpPool")
def lp_pool(cv, n):
    x = n.inputs[0]
    kernel = tuple(n.attr("kernel_shape"))
    nd = len(kernel)
    strides, dilations = tuple(n.attr("strides") or (1,) * nd), tuple(n.attr("dilations") or (1,) * nd)
    pads = spatial_pads(cv, n, cv.meta(x).shape[2:], kernel, strides, dilations)
    return pooled_by_offsets(cv, n, x, kernel, strides, dilations, pads)


@onnx_op("MaxPool", "AveragePool")
def pool(cv, n):
    x = n.inputs[0]
    kernel = tuple(n.attr("kernel_shape"))
    nd = len(kernel)
    strides = tuple(n.attr("strides") or (1,) * nd)
    dilations = tuple(n.attr("dilations") or (1,) * nd)
    pads = spatial_pads(cv, n, cv.meta(x).shape[2:], kernel, strides, dilations)
    if any(d != 1 for d in dilations) or n.attr("ceil_mode", 0) or nd > 2 or cv.meta(x).dtype not in FLOATS or \
            n.n_outputs > 1:
        return pooled_by_offsets(cv, n, x, kernel, strides, dilations, pads)
    if n.op_type == "MaxPool":
        x, even = padded(cv, x, pads, -np.inf)
        if any(2 * p > k for p, k in zip(even, kernel)):
            x, even = cv.emit("pad", x, pads=((0, 0), (0, 0)) + tuple((p, p) for p in even), mode="constant",
                              value=-np.inf), (0,) * nd
        return cv.emit("max_pool", x, kernel=kernel, stride=strides, padding=even)
    if not any(b or e for b, e in pads):
        return cv.emit("avg_pool", x, kernel=kernel, stride=strides, padding=(0,) * nd)
    rank = cv.meta(x).ndim
    widths = ((0, 0),) * (rank - nd) + tuple(pads)
    total = cv.emit("avg_pool", cv.emit("pad", x, pads=widths, mode="constant", value=0.0), kernel=kernel, stride=strides,
                    padding=(0,) * nd)
    if n.attr("count_include_pad", 0):
        return total
    sizes = cv.meta(x).shape[2:]
    if not all(isinstance(s, int) for s in sizes):
        raise SymbolicError("average pooling without the pads' count over symbolic sizes")
    ones = np.pad(np.ones((1, 1) + tuple(sizes), dtype(cv.meta(x).dtype).numpy), ((0, 0), (0, 0)) + tuple(pads))
    share = cv.emit("avg_pool", ones, kernel=kernel, stride=strides, padding=(0,) * nd)
    return cv.emit("div", total, share)


@onnx_op("GlobalAveragePool", "GlobalMaxPool")
def global_pool(cv, n):
    x = n.inputs[0]
    axes = tuple(range(2, cv.meta(x).ndim))
    return cv.emit("reduce_mean" if n.op_type == "GlobalAveragePool" else "reduce_max", x, axes=axes, keepdims=True)


# --- norms and softmax --------------------------------------------------------------------------

def normalized(cv, x, axes, eps):
    """(x - mean) / sqrt(var + eps) over `axes`, and the mean and 1/std kept for the outputs that ask."""
    mean = cv.emit("reduce_mean", x, axes=axes, keepdims=True)
    centered = cv.emit("sub", x, mean)
    var = cv.emit("reduce_mean", cv.emit("mul", centered, centered), axes=axes, keepdims=True)
    inv = cv.emit("rsqrt", cv.emit("add", var, scalar(cv, eps, var)))
    return cv.emit("mul", centered, inv), mean, inv


def channel_param(cv, p, rank):
    """A per-channel [C] parameter shaped to broadcast over [N, C, *spatial]."""
    return reshape_to(cv, p, (-1,) + (1,) * (rank - 2))


@onnx_op("BatchNormalization")
def batch_norm(cv, n):
    x, scale, bias, mean, var = n.inputs[:5]
    eps = float(n.attr("epsilon", 1e-5))
    if not n.attr("training_mode", 0):          # (before opset 7, `is_test` too: inference, as ONNX's converter reads it)
        if n.n_outputs > 1:
            raise cv.unsupported("batch normalization's running statistics outside training mode")
        if not n.attr("spatial", 1):            # before opset 9: statistics per activation, shaped as x less its batch
            scale, bias, mean, var = (reshape_to(cv, p, (1, *cv.meta(p).shape)) for p in (scale, bias, mean, var))
            inv = cv.emit("mul", scale, cv.emit("rsqrt", cv.emit("add", var, scalar(cv, eps, var))))
            return cv.emit("add", cv.emit("mul", cv.emit("sub", x, mean), inv), bias)
        return cv.emit("batchnorm", x, mean, var, scale, bias, eps=eps)
    rank = cv.meta(x).ndim                      # training: this batch's statistics, and the running ones updated
    y, batch_mean, inv = normalized(cv, x, (0, *range(2, rank)), eps)
    y = cv.emit("add", cv.emit("mul", y, channel_param(cv, scale, rank)), channel_param(cv, bias, rank))
    batch_var = cv.emit("sub", cv.emit("reciprocal", cv.emit("mul", inv, inv)), scalar(cv, eps, x))
    momentum = float(n.attr("momentum", 0.9))

    def running(old, new):
        new = reshape_to(cv, new, (-1,))
        return cv.emit("add", cv.emit("mul", old, scalar(cv, momentum, x)), cv.emit("mul", new, scalar(cv, 1 - momentum, x)))
    return y, running(mean, batch_mean), running(var, batch_var)


@onnx_op("MeanVarianceNormalization")
def mean_variance_normalization(cv, n):
    """(x - mean) / (std + 1e-9) over `axes` (by default all but the channels'), as ONNX's function defines it
    from opset 9; before, the experimental op onnxruntime still runs: over all but the channels' axes (all of
    them with `across_channels`), the division left out where `normalize_variance` is 0."""
    x = n.inputs[0]
    rank = cv.meta(x).ndim
    if n.opset >= 9:
        axes, divide = tuple(cv.axis(a, rank) for a in n.attr("axes", (0, 2, 3))), True
    else:
        axes, divide = (0, *range(1 if n.attr("across_channels", 0) else 2, rank)), n.attr("normalize_variance", 1)
    centered = cv.emit("sub", x, cv.emit("reduce_mean", x, axes=axes, keepdims=True))
    if not divide:
        return centered
    std = cv.emit("sqrt", cv.emit("reduce_mean", cv.emit("mul", centered, centered), axes=axes, keepdims=True))
    return cv.emit("div", centered, cv.emit("add", std, scalar(cv, 1e-9, x)))


@onnx_op("InstanceNormalization")
def instance_norm(cv, n):
    x, scale, bias = n.inputs
    rank = cv.meta(x).ndim
    y, _, _ = normalized(cv, x, tuple(range(2, rank)), n.attr("epsilon", 1e-5))
    return cv.emit("add", cv.emit("mul", y, channel_param(cv, scale, rank)), channel_param(cv, bias, rank))


@onnx_op("GroupNormalization")
def group_norm(cv, n):
    x, scale, bias = n.inputs
    dims = cv.meta(x).shape
    groups = int(n.attr("num_groups"))
    grouped = reshape_to(cv, x, (dims[0], groups, -1))
    y = reshape_to(cv, normalized(cv, grouped, (2,), n.attr("epsilon", 1e-5))[0], dims)
    if n.opset < 21:                  # scale and bias per group, before opset 21
        per_channel = np.repeat(np.arange(groups), dims[1] // groups)
        scale, bias = cv.emit("take", scale, per_channel, axis=0), cv.emit("take", bias, per_channel, axis=0)
    return cv.emit("add", cv.emit("mul", y, channel_param(cv, scale, len(dims))), channel_param(cv, bias, len(dims)))


@onnx_op("LayerNormalization")
def layer_norm(cv, n):
    x, scale, bias = n.input(0), n.input(1), n.input(2)
    rank = cv.meta(x).ndim
    axis = cv.axis(n.attr("axis", -1), rank)
    eps = float(n.attr("epsilon", 1e-5))
    if axis == rank - 1 and n.n_outputs == 1 and cv.meta(scale).ndim == 1 and (bias is None or cv.meta(bias).ndim == 1):
        return cv.emit("layernorm", x, scale, bias, eps=eps)
    y, mean, inv = normalized(cv, x, tuple(range(axis, rank)), eps)
    y = cv.emit("mul", y, scale)
    return (y if bias is None else cv.emit("add", y, bias)), mean, inv


@onnx_op("RMSNormalization")
def rms_norm(cv, n):
    x, scale = n.inputs
    rank = cv.meta(x).ndim
    axis = cv.axis(n.attr("axis", -1), rank)
    eps = float(n.attr("epsilon", 1e-5))
    if axis == rank - 1 and cv.meta(scale).ndim == 1:
        return cv.emit("rmsnorm", x, scale, eps=eps)
    axes = tuple(range(axis, rank))
    square = cv.emit("reduce_mean", cv.emit("mul", x, x), axes=axes, keepdims=True)
    inv = cv.emit("rsqrt", cv.emit("add", square, scalar(cv, eps, square)))
    return cv.emit("mul", cv.emit("mul", x, inv), scale)


@onnx_op("LpNormalization")
def lp_normalization(cv, n):
    x = n.inputs[0]
    axis, p = int(n.attr("axis", -1)), int(n.attr("p", 2))
    if p not in (1, 2):
        raise cv.unsupported(f"an L{p} norm (L1 and L2 are defined)")
    magnitude = cv.emit("abs", x) if p == 1 else cv.emit("mul", x, x)
    norm = cv.emit("reduce_sum", magnitude, axes=(axis,), keepdims=True)
    norm = norm if p == 1 else cv.emit("sqrt", norm)
    zero = scalar(cv, 0, x)
    return cv.emit("where", cv.emit("equal", norm, zero), zero, cv.emit("div", x, norm))       # a zero vector stays zero


def log_softmax_of(cv, x, axis):
    top = cv.emit("reduce_max", x, axes=(axis,), keepdims=True)
    shifted = cv.emit("sub", x, top)
    sums = cv.emit("reduce_sum", cv.emit("exp", shifted), axes=(axis,), keepdims=True)
    return cv.emit("sub", shifted, cv.emit("log", sums))


@onnx_op("Softmax", "LogSoftmax")
def softmax(cv, n):
    x = n.inputs[0]
    dims = cv.meta(x).shape
    axis = cv.axis(n.attr("axis", 1 if n.opset < 13 else -1), len(dims))
    if n.op_type == "LogSoftmax":
        apply = lambda v, a: log_softmax_of(cv, v, a)
    elif cv.meta(x).dtype not in FLOATS:                          # f64: the fused op's jets take the narrower floats
        apply = lambda v, a: cv.emit("exp", log_softmax_of(cv, v, a))
    else:
        apply = lambda v, a: cv.emit("softmax", v, axis=a)
    if n.opset >= 13 or axis == len(dims) - 1:
        return apply(x, axis - len(dims))           # counted from the end, as the fused ops' formulas are
    rows = reshape_to(cv, x, (product(dims[:axis]), product(dims[axis:])))      # before 13: over the flattened tail
    return reshape_to(cv, apply(rows, -1), dims)

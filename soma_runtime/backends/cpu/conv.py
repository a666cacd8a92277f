"""CPU jets for convolution (im2col + batched BLAS over groups), transposed convolution, pooling and interpolation."""
from __future__ import annotations

import itertools
import math

import numpy as np

from soma_runtime.backends.cpu.common import CPU, F, float_kernel
from soma_runtime.backends.cpu.linear import product
from soma_runtime.ir.jets import jet
from soma_runtime.ir.ops import as_tuple, source_scale


def pad(x, pads, value):
    """x with `pads` of `value` either side of its last len(pads) axes (np.pad's own overhead is a small
    convolution's whole cost)."""
    if not any(pads):
        return x
    nd = len(pads)
    out = np.full(x.shape[:-nd] + tuple(n + 2 * p for n, p in zip(x.shape[-nd:], pads)), value, x.dtype)
    out[(Ellipsis,) + tuple(slice(p, p + n) for n, p in zip(x.shape[-nd:], pads))] = x
    return out


def windows(x, kernel, stride, dilation):
    """[N, C, *spatial] -> [N, C, *out, *kernel] strided view, no copy."""
    outs = tuple((n - (k - 1) * d - 1) // s + 1 for n, k, s, d in zip(x.shape[2:], kernel, stride, dilation))
    steps = x.strides[2:]
    strides = x.strides[:2] + tuple(b * s for b, s in zip(steps, stride)) + tuple(b * d for b, d in zip(steps, dilation))
    return np.lib.stride_tricks.as_strided(x, x.shape[:2] + outs + tuple(kernel), strides, writeable=False)


LONG_SEQUENCE = 1024           # a 1-D convolution this long sums per-tap matmuls: its im2col would not fit a cache
BLOCK_BYTES = 1 << 20          # ... over blocks of outputs whose inputs and sums stay in cache across the taps


@jet("conv1d", CPU, [(F, F, F), (F, F, "none")])
@jet("conv2d", CPU, [(F, F, F), (F, F, "none")])
@float_kernel
def conv(x, weight, bias, stride, padding, dilation, groups):
    """conv1d and conv2d share one formula (hence one jet): the spatial rank comes from x."""
    nd = x.ndim - 2
    N, C = x.shape[:2]
    O, kernel = weight.shape[0], weight.shape[2:]
    st, pd, dl = as_tuple(stride, nd), as_tuple(padding, nd), as_tuple(dilation, nd)
    if nd == 1 and x.shape[2] >= LONG_SEQUENCE:
        return tap_sum(pad(x, pd, 0), weight, bias, st[0], dl[0], groups)
    cols = windows(pad(x, pd, 0), kernel, st, dl)                    # [N, C, *out, *k]
    spatial = cols.shape[2:2 + nd]
    P, K, G = math.prod(spatial), math.prod(kernel), groups
    cols = cols.reshape(N, G, C // G, P, K).transpose(1, 0, 3, 2, 4).reshape(G, N * P, (C // G) * K)
    w = weight.reshape(G, O // G, (C // G) * K)
    if G == 1:             # the matmul jet's product: a few rows (a streaming model's chunk) without BLAS's threads
        y = product(cols[0], w[0], None, True, "f32")[None]
    else:
        y = np.matmul(cols, w.transpose(0, 2, 1))                   # [G, N*P, O/G]
    y = y.reshape(G, N, P, O // G).transpose(1, 0, 3, 2).reshape(N, O, *spatial)
    return y if bias is None else y + bias.reshape((O,) + (1,) * nd)


def tap_sum(x, weight, bias, stride, dilation, groups):
    """A 1-D convolution of a padded x as the sum over kernel taps of [O/g, C/g] @ [C/g, P] matmuls, each
    on a strided view of x (no im2col copy), a block of outputs at a time."""
    N, C, length = x.shape
    O, _, K = weight.shape
    G = groups
    P = (length - (K - 1) * dilation - 1) // stride + 1
    xs = x.reshape(N, G, C // G, length)
    w = weight.reshape(G, O // G, C // G, K)
    y = np.empty((N, G, O // G, P), np.float32)
    block = max(256, BLOCK_BYTES // (4 * max(C, O)))
    part = np.empty((G, O // G, min(block, P)), np.float32)
    for n, first in itertools.product(range(N), range(0, P, block)):
        last = min(P, first + block)
        out = y[n, :, :, first:last]
        for k in range(K):
            start = first * stride + k * dilation
            view = xs[n, :, :, start:start + stride * (last - first - 1) + 1:stride]
            np.matmul(w[:, :, :, k], view, out=out if k == 0 else part[:, :, :last - first])
            if k:
                out += part[:, :, :last - first]
    y = y.reshape(N, O, P)
    return y if bias is None else y + bias.reshape(O, 1)


@jet("conv_transpose1d", CPU, [(F, F, F), (F, F, "none")])
@jet("conv_transpose2d", CPU, [(F, F, F), (F, F, "none")])
@jet("conv_transpose3d", CPU, [(F, F, F), (F, F, "none")])
@float_kernel
def conv_transpose(x, weight, bias, stride, dilation, groups, crop):
    """Each input times the kernel, overlap-added `stride` apart: one matmul per group ([O/g * K, C/g] @
    [C/g, N * spatial]), then one strided add per kernel offset (no zeros multiplied, as a zero-spread
    input convolved would)."""
    nd = x.ndim - 2
    N, C, spatial = x.shape[0], x.shape[1], x.shape[2:]
    kernel, G = weight.shape[2:], groups
    Og = weight.shape[1]
    st, dl = as_tuple(stride, nd), as_tuple(dilation, nd)
    crops = tuple(crop) or ((0, 0),) * nd
    xs = x.reshape(N, G, C // G, -1).transpose(1, 2, 0, 3).reshape(G, C // G, -1)
    z = np.matmul(weight.reshape(G, C // G, -1).transpose(0, 2, 1), xs)              # [G, Og * K, N * P]
    z = np.moveaxis(z.reshape(G * Og, *kernel, N, *spatial), 1 + nd, 0)               # [N, O, *kernel, *spatial]
    full = [s * (n - 1) + (k - 1) * d + 1 for n, k, s, d in zip(spatial, kernel, st, dl)]
    y = np.zeros((N, G * Og, *(f + max(0, -c[1]) for f, c in zip(full, crops))), np.float32)
    for offsets in itertools.product(*(range(k) for k in kernel)):
        into = tuple(slice(o * d, o * d + s * (n - 1) + 1, s) for o, d, s, n in zip(offsets, dl, st, spatial))
        y[(slice(None), slice(None)) + into] += z[(slice(None), slice(None)) + offsets]
    y = y[(slice(None), slice(None)) + tuple(slice(c[0], y.shape[2 + i] - max(0, c[1])) for i, c in enumerate(crops))]
    return y if bias is None else y + bias.reshape((-1,) + (1,) * nd)


def pool(x, kernel, stride, padding, reduce, pad_value):
    nd = len(kernel)
    st, pd = as_tuple(stride or kernel, nd), as_tuple(padding, nd)
    w = windows(pad(x, pd, pad_value), kernel, st, (1,) * nd)
    return reduce(w, axis=tuple(range(-nd, 0)))


@jet("max_pool", CPU, [(F,)])
@float_kernel
def max_pool(x, **attrs): return pool(x, reduce=np.max, pad_value=-np.inf, **attrs)


@jet("avg_pool", CPU, [(F,)])
@float_kernel
def avg_pool(x, **attrs): return pool(x, reduce=np.mean, pad_value=0.0, **attrs)


def resample(x, axis, n_out, mode, align_corners):
    n_in = x.shape[axis]
    dst = np.arange(n_out, dtype=np.float32)
    scale = np.float32(source_scale(n_in, n_out, align_corners))
    if mode == "nearest":
        return np.take(x, np.minimum(np.floor(dst * scale), n_in - 1).astype(np.int64), axis=axis)
    src = dst * scale if align_corners else np.maximum((dst + np.float32(0.5)) * scale - np.float32(0.5), 0)
    lower = np.floor(src)
    frac = (src - lower).reshape((n_out,) + (1,) * (-1 - axis))
    i0 = lower.astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return np.take(x, i0, axis=axis) * (1 - frac) + np.take(x, i1, axis=axis) * frac


@jet("interpolate", CPU, [(F,)])
@float_kernel
def interpolate(x, size, mode, align_corners):
    for i, n_out in enumerate(size):
        x = resample(x, i - len(size), n_out, mode, align_corners)
    return x

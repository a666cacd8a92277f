"""CPU jets for convolution (im2col + batched BLAS over groups), pooling and interpolation."""
from __future__ import annotations

import numpy as np

from soma_runtime.backends.cpu.common import CPU, F, float_kernel
from soma_runtime.ir.jets import jet
from soma_runtime.ir.ops import as_tuple, source_scale


def pad(x, pads, value):
    nd = len(pads)
    return np.pad(x, [(0, 0)] * (x.ndim - nd) + [(p, p) for p in pads], constant_values=value)


def windows(x, kernel, stride, dilation):
    """[N, C, *spatial] -> [N, C, *out, *kernel] strided view, no copy."""
    nd = len(kernel)
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilation)]
    v = np.lib.stride_tricks.sliding_window_view(x, span, axis=tuple(range(2, 2 + nd)))
    index = (slice(None),) * 2 + tuple(slice(None, None, s) for s in stride) + tuple(slice(None, None, d) for d in dilation)
    return v[index]


@jet("conv1d", CPU, [(F, F, F), (F, F, "none")])
@jet("conv2d", CPU, [(F, F, F), (F, F, "none")])
@float_kernel
def conv(x, weight, bias, stride, padding, dilation, groups):
    """conv1d and conv2d share one formula (hence one jet): the spatial rank comes from x."""
    nd = x.ndim - 2
    N, C = x.shape[:2]
    O, kernel = weight.shape[0], weight.shape[2:]
    st, pd, dl = as_tuple(stride, nd), as_tuple(padding, nd), as_tuple(dilation, nd)
    cols = windows(pad(x, pd, 0), kernel, st, dl)                    # [N, C, *out, *k]
    spatial = cols.shape[2:2 + nd]
    P, K, G = int(np.prod(spatial)), int(np.prod(kernel)), groups
    cols = cols.reshape(N, G, C // G, P, K).transpose(1, 0, 3, 2, 4).reshape(G, N * P, (C // G) * K)
    w = weight.reshape(G, O // G, (C // G) * K)
    y = np.matmul(cols, w.transpose(0, 2, 1))                       # [G, N*P, O/G]
    y = y.reshape(G, N, P, O // G).transpose(1, 0, 3, 2).reshape(N, O, *spatial)
    return y if bias is None else y + bias.reshape((O,) + (1,) * nd)


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

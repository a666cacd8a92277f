"""CUDA jets for convolution: the windows copied out (im2col) and multiplied on the tensor cores by the
matmul jet's kernels; a transposed convolution as one product per group and an overlap-add per kernel
offset (no zeros multiplied)."""
from __future__ import annotations

import itertools
import math

import torch

from soma_runtime.backends.cuda.device import CUDA, F, device_jet
from soma_runtime.backends.cuda.elementwise import BINARY, UNARY, binary, unary
from soma_runtime.backends.cuda.linear import dense_matmul
from soma_runtime.ir.jets import jet
from soma_runtime.ir.ops import as_tuple


def biased(y: torch.Tensor, bias, nd: int) -> torch.Tensor:
    return y if bias is None else binary(y, bias.reshape((-1,) + (1,) * nd), BINARY["add"])


def finished(y: torch.Tensor, residual, epilogue: str) -> torch.Tensor:
    """epilogue(y + residual), a convolution's fused tail (ir/ops/conv.py's CONV_EPILOGUES)."""
    y = y if residual is None else binary(y, residual, BINARY["add"])
    if epilogue == "relu6":
        return unary(y, UNARY["clip"], min=0.0, max=6.0)
    return y if epilogue == "none" else unary(y, UNARY[epilogue])


@jet("conv1d", CUDA, [(F, F, b, r) for b in (F, "none") for r in (F, "none")])
@jet("conv2d", CUDA, [(F, F, b, r) for b in (F, "none") for r in (F, "none")])
@device_jet
def conv(x, weight, bias=None, residual=None, stride=1, padding=0, dilation=1, groups=1, epilogue="none"):
    nd = x.ndim - 2
    st, pd, dl = as_tuple(stride, nd), as_tuple(padding, nd), as_tuple(dilation, nd)
    if any(pd):
        padded = x.new_zeros(x.shape[:2] + tuple(n + 2 * p for n, p in zip(x.shape[2:], pd)))
        padded[(slice(None),) * 2 + tuple(slice(p, p + n) for n, p in zip(x.shape[2:], pd))] = x
        x = padded
    N, C, O, kernel, G = x.shape[0], x.shape[1], weight.shape[0], tuple(weight.shape[2:]), groups
    outs = tuple((n - (k - 1) * d - 1) // s + 1 for n, k, s, d in zip(x.shape[2:], kernel, st, dl))
    steps = x.stride()[2:]
    windows = x.as_strided(x.shape[:2] + outs + kernel, x.stride()[:2] + tuple(b * s for b, s in zip(steps, st))
                           + tuple(b * d for b, d in zip(steps, dl)))
    P, K = math.prod(outs), math.prod(kernel)
    cols = windows.reshape(N, G, C // G, P, K).permute(1, 0, 3, 2, 4).reshape(G, N * P, (C // G) * K)
    y = dense_matmul(cols, weight.reshape(G, O // G, (C // G) * K), transpose_b=True)       # [G, N*P, O/G]
    return finished(biased(y.reshape(G, N, P, O // G).permute(1, 0, 3, 2).reshape(N, O, *outs), bias, nd), residual, epilogue)


@jet("conv_transpose1d", CUDA, [(F, F, F), (F, F, "none")])
@jet("conv_transpose2d", CUDA, [(F, F, F), (F, F, "none")])
@jet("conv_transpose3d", CUDA, [(F, F, F), (F, F, "none")])
@device_jet
def conv_transpose(x, weight, bias=None, stride=1, dilation=1, groups=1, crop=()):
    nd = x.ndim - 2
    N, C, spatial = x.shape[0], x.shape[1], tuple(x.shape[2:])
    kernel, G, Og = tuple(weight.shape[2:]), groups, weight.shape[1]
    st, dl = as_tuple(stride, nd), as_tuple(dilation, nd)
    crops = tuple(crop) or ((0, 0),) * nd
    xs = x.reshape(N, G, C // G, -1).permute(1, 2, 0, 3).reshape(G, C // G, -1)
    z = dense_matmul(weight.reshape(G, C // G, -1).transpose(1, 2), xs, transpose_b=False)       # [G, Og*K, N*P]
    z = z.reshape(G * Og, *kernel, N, *spatial).movedim(1 + nd, 0)                           # [N, O, *kernel, *spatial]
    full = [s * (n - 1) + (k - 1) * d + 1 for n, k, s, d in zip(spatial, kernel, st, dl)]
    y = x.new_zeros((N, G * Og, *(f + max(0, -c[1]) for f, c in zip(full, crops))))
    for offsets in itertools.product(*(range(k) for k in kernel)):
        into = tuple(slice(o * d, o * d + s * (n - 1) + 1, s) for o, d, s, n in zip(offsets, dl, st, spatial))
        y[(slice(None), slice(None)) + into] += z[(slice(None), slice(None)) + offsets]
    y = y[(slice(None), slice(None)) + tuple(slice(c[0], y.shape[2 + i] - max(0, c[1])) for i, c in enumerate(crops))]
    return biased(y.contiguous(), bias, nd)

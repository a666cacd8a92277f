"""CUDA jets for convolution: the windows copied out (im2col) and multiplied on the tensor cores by the
matmul jet's kernels; a transposed convolution as one product per group and an overlap-add per kernel
offset (no zeros multiplied). Pooling and resampling: one Triton program per block of outputs, each
reading its window (its two neighbours an axis) in place."""
from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import CUDA, F, device_jet
from soma_runtime.backends.cuda.elementwise import BINARY, BLOCK, UNARY, binary, flat_grid, unary
from soma_runtime.backends.cuda.linear import dense_matmul
from soma_runtime.ir.jets import jet
from soma_runtime.ir.ops import as_tuple
from soma_runtime.ir.ops.conv import source_scale


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


@chained
@triton.jit
def _pool_kernel(x_ptr, out_ptr, total, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, PD, PH, PW,
                 AVERAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Outputs of x [planes, D, H, W]: the max (AVERAGE: the mean, padding counted as zeros) of each
    window; a window's places in the padding are skipped."""
    after_prior()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < total
    ow, oh, od, plane = offs % OW, offs // OW % OH, offs // (OW * OH) % OD, offs // (OW * OH * OD)
    acc = tl.full((BLOCK,), 0.0 if AVERAGE else -float("inf"), tl.float32)
    for i in range(KD):
        d = od * SD - PD + i
        for j in range(KH):
            h = oh * SH - PH + j
            for k in range(KW):
                w = ow * SW - PW + k
                inside = keep & (d >= 0) & (d < D) & (h >= 0) & (h < H) & (w >= 0) & (w < W)
                v = tl.load(x_ptr + ((plane * D + d) * H + h) * W + w, mask=inside,
                            other=0.0 if AVERAGE else -float("inf")).to(tl.float32)
                acc = acc + v if AVERAGE else tl.maximum(acc, v)
    if AVERAGE:
        acc = acc / (KD * KH * KW)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=keep)


def leading(values, unit, rank: int = 3) -> tuple:
    """Per-axis values of fewer spatial axes as `rank` of them, unit values before."""
    return (unit,) * (rank - len(values)) + tuple(values)


def pool(x, kernel, stride, padding, average):
    """Pooling of 1-3 spatial axes, run as three (leading unit axes added)."""
    nd = len(kernel)
    (kd, kh, kw), (sd, sh, sw) = leading(kernel, 1), leading(as_tuple(stride or kernel, nd), 1)
    pd, ph, pw = leading(as_tuple(padding, nd), 0)
    x = x.contiguous()
    D, H, W = leading(x.shape[2:], 1)
    outs = tuple((n + 2 * p - k) // s + 1 for n, k, s, p in zip((D, H, W), (kd, kh, kw), (sd, sh, sw), (pd, ph, pw)))
    out = torch.empty(x.shape[:2] + outs[3 - nd:], dtype=x.dtype, device=x.device)
    if out.numel():
        _pool_kernel[flat_grid(out.numel())](x, out, out.numel(), D, H, W, *outs, kd, kh, kw, sd, sh, sw, pd, ph, pw,
                                             AVERAGE=average, BLOCK=BLOCK)
    return out


@jet("max_pool", CUDA, [(F,)])
@device_jet
def max_pool(x, kernel=(2, 2), stride=None, padding=0):
    return pool(x, kernel, stride, padding, average=False)


@jet("avg_pool", CUDA, [(F,)])
@device_jet
def avg_pool(x, kernel=(2, 2), stride=None, padding=0):
    return pool(x, kernel, stride, padding, average=True)


@triton.jit
def _source(dst, scale, n, NEAREST: tl.constexpr, HALF: tl.constexpr):
    """Where output position `dst` of an axis reads its n inputs: the lower and upper neighbours and the
    upper's weight (nearest: one index, weight 0). HALF: pixel centres (align_corners off)."""
    at = dst.to(tl.float32)
    if NEAREST:
        lower = tl.minimum(tl.floor(at * scale), n - 1)
        frac = at * 0.0
    else:
        src = tl.maximum((at + 0.5) * scale - 0.5, 0.0) if HALF else at * scale
        lower = tl.floor(src)
        frac = src - lower
    i0 = lower.to(tl.int64)
    return i0, tl.minimum(i0 + 1, n - 1), frac


@chained
@triton.jit
def _resample_kernel(x_ptr, out_ptr, total, H, W, OH, OW, scale_h, scale_w, NEAREST: tl.constexpr, HALF: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Outputs of x [planes, H, W] resampled to [planes, OH, OW]: nearest, or bilinear (rows blended first,
    as the CPU jet's axis after axis)."""
    after_prior()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < total
    ow, oh, plane = offs % OW, offs // OW % OH, offs // (OW * OH)
    h0, h1, fh = _source(oh, scale_h, H, NEAREST, HALF)
    w0, w1, fw = _source(ow, scale_w, W, NEAREST, HALF)
    base = x_ptr + plane * H * W
    if NEAREST:
        y = tl.load(base + h0 * W + w0, mask=keep).to(tl.float32)
    else:
        left = tl.load(base + h0 * W + w0, mask=keep).to(tl.float32) * (1 - fh) + \
            tl.load(base + h1 * W + w0, mask=keep).to(tl.float32) * fh
        right = tl.load(base + h0 * W + w1, mask=keep).to(tl.float32) * (1 - fh) + \
            tl.load(base + h1 * W + w1, mask=keep).to(tl.float32) * fh
        y = left * (1 - fw) + right * fw
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=keep)


@jet("interpolate", CUDA, [(F,)])
@device_jet
def interpolate(x, size=(1, 1), mode="nearest", align_corners=False):
    """x [N, C, *spatial] resampled to `size` (one or two axes; one is run as two, the first of size 1)."""
    size = tuple(size)
    x = x.contiguous()
    (H, W), (OH, OW) = leading(x.shape[2:], 1, 2), leading(size, 1, 2)
    out = torch.empty(x.shape[:2] + size, dtype=x.dtype, device=x.device)
    if out.numel():
        _resample_kernel[flat_grid(out.numel())](x, out, out.numel(), H, W, OH, OW, source_scale(H, OH, align_corners),
                                                 source_scale(W, OW, align_corners), NEAREST=mode == "nearest",
                                                 HALF=not align_corners, BLOCK=BLOCK)
    return out

"""CUDA jets for convolution: an implicit GEMM on the tensor cores (each window's inputs read where they lie,
no padded copy and no columns; bias, residual and activation in the same kernel), a depthwise one as a
direct sum of taps; a transposed convolution as one product per group and an overlap-add per kernel
offset (no zeros multiplied). Pooling and resampling: one Triton program per block of outputs, each
reading its window (its two neighbours an axis) in place."""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import CUDA, F, device_jet
from soma_runtime.backends.cuda.elementwise import BINARY, BLOCK, binary, flat_grid
from soma_runtime.backends.cuda.linear import dense_matmul
from soma_runtime.ir.jets import jet
from soma_runtime.ir.ops import as_tuple
from soma_runtime.ir.ops.conv import source_scale

EPILOGUES = {"none": 0, "relu": 1, "relu6": 2, "silu": 3}   # ir/ops/conv.py's CONV_EPILOGUES, as kernel codes


def biased(y: torch.Tensor, bias, nd: int) -> torch.Tensor:
    return y if bias is None else binary(y, bias.reshape((-1,) + (1,) * nd), BINARY["add"])


@triton.jit
def _finish(y, bias_ptr, res_ptr, o, at, keep, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, EPILOGUE: tl.constexpr):
    """epilogue(y + bias[o] + residual[at]): a convolution's fused tail."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + o, mask=keep, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(res_ptr + at, mask=keep, other=0.0).to(tl.float32)
    if EPILOGUE == 1:
        y = tl.maximum(y, 0.0)
    elif EPILOGUE == 2:
        y = tl.minimum(tl.maximum(y, 0.0), 6.0)
    elif EPILOGUE == 3:
        y = y / (1.0 + tl.exp(-y))
    return y


@chained
@triton.jit
def _conv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, C, H, W, O, OH, OW, CG, OG, KH, KW, SH, SW, PH, PW, DH, DW,
                 COLS, KTOT, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, EPILOGUE: tl.constexpr, F32: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[n, g*OG + o, p] for BM output channels o of group g and BN output places (image n, place p, flattened
    into one axis of COLS): the sum over k = (c, kh, kw) of the group's weight [o, k] times the input at that
    place of the window (zero in the padding), read where it lies (an implicit GEMM: no padded copy, no
    columns), then the bias, residual and epilogue. f32 through the tensor cores as tf32x3 (f32 accuracy)."""
    after_prior()
    pm, pn, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o = pm * BM + tl.arange(0, BM)
    j = pn * BN + tl.arange(0, BN)
    P = OH * OW
    n, p = (j // P).to(tl.int64), j % P
    ih0, iw0 = (p // OW) * SH - PH, (p % OW) * SW - PW
    x_at = x_ptr + (n * C + g * CG) * H * W
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, KTOT, BK):
        k = k0 + tl.arange(0, BK)
        c, kh, kw = k // (KH * KW), k // KW % KH, k % KW
        a = tl.load(w_ptr + (g * OG + o)[:, None] * KTOT + k[None, :], mask=(o[:, None] < OG) & (k[None, :] < KTOT),
                    other=0.0)
        ih, iw = ih0[None, :] + kh[:, None] * DH, iw0[None, :] + kw[:, None] * DW
        inside = (k[:, None] < KTOT) & (j[None, :] < COLS) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        b = tl.load(x_at[None, :] + c[:, None] * H * W + ih * W + iw, mask=inside, other=0.0)
        if F32:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
        else:
            acc += tl.dot(a, b.to(a.dtype))
    keep = (o[:, None] < OG) & (j[None, :] < COLS)
    at = (n[None, :] * O + g * OG + o[:, None]) * P + p[None, :]
    y = _finish(acc, bias_ptr, res_ptr, g * OG + o[:, None], at, keep, HAS_BIAS, HAS_RES, EPILOGUE)
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=keep)


@chained
@triton.jit
def _depthwise_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, total, C, H, W, O, OH, OW, KH, KW, SH, SW, PH, PW, DH, DW,
                      HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK: tl.constexpr):
    """A convolution of one input channel a group (output channel o reads channel o // (O / C)): each output
    the sum of its window's taps, multiplied in f32 where they lie, then the bias, residual and epilogue."""
    after_prior()
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = at < total
    p, plane = at % (OH * OW), at // (OH * OW)
    o, n = plane % O, plane // O
    ih0, iw0 = (p // OW) * SH - PH, (p % OW) * SW - PW
    x_at = x_ptr + (n * C + o // (O // C)) * H * W
    acc = tl.zeros((BLOCK,), tl.float32)
    for kh in range(KH):
        ih = ih0 + kh * DH
        for kw in range(KW):
            iw = iw0 + kw * DW
            inside = keep & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            v = tl.load(x_at + ih * W + iw, mask=inside, other=0.0).to(tl.float32)
            acc += v * tl.load(w_ptr + (o * KH + kh) * KW + kw, mask=keep, other=0.0).to(tl.float32)
    y = _finish(acc, bias_ptr, res_ptr, o, at, keep, HAS_BIAS, HAS_RES, EPILOGUE)
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=keep)


def conv_tiles(cols: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, warps) of the implicit GEMM, as swept on an H100 over resnet18's and mobilenet_v2's layers at
    batch 1 and 32 (bench/conv_cuda.py): narrow tiles of output channels, so even a small image's layers
    fill the GPU; 32 channels a tile where there are many places."""
    return (16 if cols <= 4096 else 32), 64, 32, 4


@jet("conv1d", CUDA, [(F, F, b, r) for b in (F, "none") for r in (F, "none")])
@jet("conv2d", CUDA, [(F, F, b, r) for b in (F, "none") for r in (F, "none")])
@device_jet
def conv(x, weight, bias=None, residual=None, stride=1, padding=0, dilation=1, groups=1, epilogue="none"):
    """A convolution of one or two spatial axes (one run as two, the first of size 1), its tail fused."""
    nd = x.ndim - 2
    (sh, sw), (ph, pw), (dh, dw) = (leading(as_tuple(v, nd), unit, 2) for v, unit in ((stride, 1), (padding, 0), (dilation, 1)))
    x, weight = x.contiguous(), weight.contiguous()
    (H, W), (KH, KW) = leading(x.shape[2:], 1, 2), leading(weight.shape[2:], 1, 2)
    N, C, O, G = x.shape[0], x.shape[1], weight.shape[0], groups
    OH, OW = (H + 2 * ph - (KH - 1) * dh - 1) // sh + 1, (W + 2 * pw - (KW - 1) * dw - 1) // sw + 1
    out = torch.empty((N, O) + (OH, OW)[2 - nd:], dtype=x.dtype, device=x.device)
    residual = None if residual is None else residual.expand(out.shape).contiguous()
    if out.numel() == 0:
        return out
    tail = {"HAS_BIAS": bias is not None, "HAS_RES": residual is not None, "EPILOGUE": EPILOGUES[epilogue]}
    b, r = (bias if bias is not None else out), (residual if residual is not None else out)
    geometry = (KH, KW, sh, sw, ph, pw, dh, dw)
    if C == G:                                   # depthwise: one input channel a group
        _depthwise_kernel[flat_grid(out.numel())](x, weight, b, r, out, out.numel(), C, H, W, O, OH, OW, *geometry,
                                                  BLOCK=BLOCK, **tail)
        return out
    cols, ktot = N * OH * OW, (C // G) * KH * KW
    BM, BN, BK, warps = conv_tiles(cols)
    _conv_kernel[(triton.cdiv(O // G, BM), triton.cdiv(cols, BN), G)](
        x, weight, b, r, out, C, H, W, O, OH, OW, C // G, O // G, *geometry, cols, ktot,
        F32=x.dtype == torch.float32, BM=BM, BN=BN, BK=BK, num_warps=warps, **tail)
    return out


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

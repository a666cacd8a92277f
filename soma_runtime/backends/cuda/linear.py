"""The matmul jet: dense products here (a matrix-vector kernel per activation row for decode, a
decode batch's f32 rows against bf16 weights on the tensor cores, tiles for prompts), quantized
weights in quantized.py; the norm, gate and residual fused around them (fused.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.blocks import QUANTIZED
from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import CUDA, INTERPRET, DeviceQTensor, F, device_jet
from soma_runtime.backends.cuda.elementwise import BINARY, UNARY, binary, gated_pairs, unary
from soma_runtime.backends.cuda.fused import GATES, NO_GATE, finished, gemv_residual, normalized, store_products, with_residual
from soma_runtime.backends.cuda.quantized import GEMV_ROWS, quantized_matmul
from soma_runtime.ir.jets import jet

BF16_DOT = tl.constexpr(not INTERPRET)
SKINNY_ROWS = 64       # up to this many activation rows, against bf16 weights, the decode-batch kernel
CACHED_WEIGHT = 65536  # a weight this small (a KV basis, 64 x 64 to 256 x 256) stays in cache: a matrix-vector
#                        kernel per row beats tiles of rows (a decode's 32 heads rotated: 8-25 -> 1.4-2 us, H100)
INTERPRETED_ROWS = 128 # interpreted, a matrix-vector program's weight rows
MAX_GRID_Y = 65535     # the most programs a launch grid's second dimension takes
# dense matrix-vector (BN, BK, warps) for N rows up to K long: the first (longest K, most N) that holds, as swept
# on an H200 in place in decode steps (bench/sweep_cuda.py): the o projection, qkv, gate_up, a vocabulary head, 8B
GEMV_TILES = ((1024, None, (4, 1024, 2)),
              (2048, 2048, (4, 2048, 4)),
              (2048, 8191, (4, 1024, 2)),
              (2048, 65535, (8, 512, 2)),
              (2048, None, (8, 1024, 4)),
              (8191, None, (8, 512, 2)), (8192, None, (4, 2048, 4)), (None, None, (8, 1024, 4)))


@chained
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, g_ptr, res_ptr, out_ptr, N, K, swn, swk, eps, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                 GATE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One activation row times BN dense weight rows (any float type, read once, f32 math). With NORM,
    of the row rms-normalized by weight g: the products of x * g, scaled by the row's 1/rms, whose
    squares are summed in the same pass; with a GATE, over (gate, up) row pairs. Weights load after the
    wait, in one pass: every earlier load tried lost (bench/results/design-notes.md)."""
    after_prior()
    pn, m = tl.program_id(0), tl.program_id(1)
    n = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BN, BK), tl.float32)
    squares = tl.zeros((BK,), tl.float32)
    for k0 in tl.range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + n[:, None] * swn + k[None, :] * swk, mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = tl.load(x_ptr + m * K + k, mask=k < K, other=0.0).to(tl.float32)
        if NORM:
            squares += x * x
            x = x * tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if NORM:
        y = y * tl.div_rn(1.0, tl.sqrt_rn(tl.sum(squares, 0) / K + eps))
    store_products(out_ptr, res_ptr, m, N, pn, y, HAS_RES, GATE, BN)


@chained
@triton.jit
def _matmul_kernel(a_ptr, b_ptr, out_ptr, M, N, K, sab, sam, sak, sbb, sbn, sbk,
                   F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[batch, M, N] = a[batch, M, K] @ b[batch, N, K]^T over strided (possibly broadcast) views.
    f32 operands go through the tensor cores as tf32x3 (split into high and low parts: f32 accuracy)."""
    after_prior()
    pm, pn, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pm * BM + tl.arange(0, BM)
    n = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + batch * sab + m[:, None] * sam + k[None, :] * sak, mask=(m[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        b = tl.load(b_ptr + batch * sbb + n[:, None] * sbn + k[None, :] * sbk, mask=(n[:, None] < N) & (k[None, :] < K),
                    other=0.0)
        if F32:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="tf32x3")
        else:
            acc += tl.dot(a, tl.trans(b.to(a.dtype)))
    tl.store(out_ptr + batch * M * N + m[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _bf16_dot(w, x, acc):
    """acc + w @ x^T on bf16 tensor cores. Triton's interpreter gets bf16 dots wrong: there the same
    values, exact in f32, are multiplied in f32."""
    if BF16_DOT:
        return tl.dot(w, tl.trans(x), acc)
    return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")


@chained
@triton.jit
def _skinny_matmul_kernel(a_ptr, b_ptr, out_ptr, M, N, K, sbn, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                          SPLIT: tl.constexpr):
    """out[M, N] (split s of K: out[s, M, N]) = a[M, K] @ b[N, K]^T for a few f32 rows against bf16
    weights: the weight is the tensor cores' wide operand (BN of its rows a program), and each f32
    row enters as three bf16 parts, high to low, each product exact: f32 accuracy in three bf16 MMAs
    (tf32x3 takes three tf32 ones, at half the rate, and splits the weight for nothing)."""
    after_prior()
    pn, split = tl.program_id(0), tl.program_id(1)
    n = pn * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros((BN, BM), tl.float32)
    for k0 in tl.range(split * BK, K, BK * SPLIT):
        k = k0 + tl.arange(0, BK)
        w = tl.load(b_ptr + n[:, None] * sbn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = tl.load(a_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        high = x.to(tl.bfloat16)
        rest = x - high.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        low = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        # a step's products sum apart, then join in one rounded f32 add: tensor-core accumulations truncate
        acc += _bf16_dot(w, low, _bf16_dot(w, mid, _bf16_dot(w, high, tl.zeros((BN, BM), tl.float32))))
    tl.store(out_ptr + split * M * N + m[None, :] * N + n[:, None], acc, mask=(m[None, :] < M) & (n[:, None] < N))


@chained
@triton.jit
def _sum_splits_kernel(parts_ptr, res_ptr, out_ptr, total, SPLIT: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """out = the K splits' partial products summed (+ the residual)."""
    after_prior()
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(parts_ptr + s * total + at, mask=at < total, other=0.0)
    if HAS_RES:
        acc += tl.load(res_ptr + at, mask=at < total, other=0.0)
    tl.store(out_ptr + at, acc, mask=at < total)


def matmul_tiles(M: int, N: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, warps) for an [M, N] product, as swept on an H200 (f32 x bf16, 1B shapes): a decode
    batch takes narrow column tiles with long steps, so many programs share the weight read; long
    prompts take square tiles, larger where there are many columns."""
    if M <= 64:
        return (min(32, max(16, triton.next_power_of_2(M))), 64, 64, 4) if N >= 8192 else (16, 32, 256, 4)
    return (128, 128, 32, 8) if N >= 8192 else (64, 64, 64, 4)


def skinny_tiles(N: int) -> tuple[int, int, int, int, int]:
    """(BN, BK, warps, stages, K splits) for a few rows against an [N, K] bf16 weight, as swept on an
    H200 at 32 rows (1B and 8B shapes, L2 cold): narrow layers split K four ways to fill the GPU."""
    if N >= 16384:
        return (128, 64, 8, 4, 2 if N < 24576 else 1)
    return (64, 128, 4, 3, 4) if N <= 2048 else (128, 128, 8, 3, 4)


def skinny_matmul(rows: torch.Tensor, w: torch.Tensor, residual=None, gate=NO_GATE) -> torch.Tensor:
    """[M, K] f32 rows @ [N, K]^T bf16, for a decode batch (see _skinny_matmul_kernel)."""
    (M, K), N = rows.shape, w.shape[0]
    BN, BK, warps, stages, split = skinny_tiles(N)
    out = torch.empty((M, N), dtype=torch.float32, device=rows.device)
    parts = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=rows.device)
    _skinny_matmul_kernel[(triton.cdiv(N, BN), split)](rows, w, parts, M, N, K, w.stride(0), BN=BN,
                                                      BM=max(16, triton.next_power_of_2(M)), BK=BK, SPLIT=split,
                                                      num_warps=warps, num_stages=stages)
    join = residual if split > 1 and gate == NO_GATE else None      # added as the K splits sum (a gate comes first)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](parts, gemv_residual(join, out), out, M * N, SPLIT=split,
                                                       HAS_RES=join is not None, BLOCK=1024)
    return finished(out, gate, None if join is not None else residual)


def gemv_tiles(N: int, K: int) -> tuple[int, int, int]:
    """(BN, BK, warps) for N dense rows K long: GEMV_TILES' first rule that holds (bench/sweep_cuda.py tries others).
    Interpreted (no GPU: the tests), wide tiles: the interpreter's time goes by programs, not by their width
    (16 warps: the launches, compiled for sm_90 by the tests, hold them without spilling)."""
    if INTERPRET:
        return min(INTERPRETED_ROWS, triton.next_power_of_2(N)), 64, 16
    return next(tiles for longest, most, tiles in GEMV_TILES if (longest is None or K <= longest) and (most is None or N <= most))


def dense_matmul(a: torch.Tensor, b: torch.Tensor, transpose_b: bool, residual=None, norm=None, gate=NO_GATE) -> torch.Tensor:
    bt = b if transpose_b else b.transpose(-1, -2)           # [..., N, K] either way, as strides
    count = a.numel() // a.shape[-1]
    if bt.ndim == 2 and (count <= GEMV_ROWS or bt.numel() <= CACHED_WEIGHT and count <= MAX_GRID_Y):
        rows = a.reshape(-1, a.shape[-1]).contiguous()
        N, K = bt.shape
        out = torch.empty((rows.shape[0], N if gate == NO_GATE else N // 2), dtype=a.dtype, device=a.device)
        BN, BK, warps = gemv_tiles(N, K)
        weight, eps = (rows, 0.0) if norm is None else (norm[0], float(norm[1]))
        _gemv_kernel[(triton.cdiv(N, BN), rows.shape[0])](rows, bt, weight, gemv_residual(residual, out), out, N, K, bt.stride(0),
                                                          bt.stride(1), eps, NORM=norm is not None, HAS_RES=residual is not None,
                                                          GATE=gate, BN=BN, BK=BK, num_warps=warps)
        return out.reshape(*a.shape[:-1], out.shape[1])
    if norm is not None:
        a = normalized(a.contiguous(), norm)
    skinny = count <= SKINNY_ROWS
    if bt.ndim == 2 and a.dtype == torch.float32 and bt.dtype == torch.bfloat16 and bt.stride(1) == 1 and skinny:
        rows = a.reshape(-1, a.shape[-1]).contiguous()
        out = skinny_matmul(rows, bt, residual, gate)
        return out.reshape(*a.shape[:-1], out.shape[-1])
    batch = torch.broadcast_shapes(a.shape[:-2], bt.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], bt.shape[-2]
    a3 = a.expand(*batch, M, K).reshape(-1, M, K) if batch else a.reshape(1, M, K)
    b3 = bt.expand(*batch, N, K).reshape(-1, N, K) if batch else bt.reshape(1, N, K)
    out = torch.empty((a3.shape[0], M, N), dtype=a.dtype, device=a.device)
    BM, BN, BK, warps = matmul_tiles(M, N)
    _matmul_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), a3.shape[0])](
        a3, b3, out, M, N, K, a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1), b3.stride(2),
        F32=a.dtype == torch.float32, BM=BM, BN=BN, BK=BK, num_warps=warps)
    return finished(out.reshape(*batch, M, N), gate, residual)


@jet("matmul", CUDA, [(F, F, b, r, n) for b in ("none", F) for r in ("none", F) for n in ("none", F)]
     + [("f32", q, b, r, n) for q in QUANTIZED for b in ("none", "f32") for r in ("none", "f32") for n in ("none", "f32")])
@device_jet
def matmul(a, b, bias=None, residual=None, norm=None, transpose_b=False, activations="f32", epilogue="none", norm_eps=1e-6):
    norm = None if norm is None else (norm, norm_eps)
    if bias is None and epilogue in ("none", *GATES):        # the residual and a gate join inside the GEMV kernels
        return product(a, b, transpose_b, activations, residual, norm, GATES.get(epilogue, NO_GATE))
    y = product(a, b, transpose_b, activations, None, norm)
    y = y if bias is None else binary(y, bias, BINARY["add"])
    if epilogue in GATES:
        y = gated_pairs(y, GATES[epilogue])
    elif epilogue != "none":
        y = unary(y, UNARY["gelu"], approximate="tanh" if epilogue == "gelu_tanh" else "none")
    return with_residual(y, residual)


def product(a, b, transpose_b, activations, residual=None, norm=None, gate=NO_GATE):
    """rmsnorm(a) @ b, gated (+ residual): the norm, norm = (weight, eps), the gate (an `activate` kind
    over interleaved column pairs) and the residual folded into the matrix-vector kernels (decode) and
    the gate into the quantized ones; applied around the others."""
    if isinstance(b, DeviceQTensor):
        return quantized_matmul(a, b, activations == "q8", residual, norm, gate)
    if a.ndim > 1 and b.ndim > 1:
        return dense_matmul(a, b, transpose_b, residual, norm, gate)
    # vectors, as numpy: a one-row (or one-column) matrix, squeezed afterwards
    a = normalized(a, norm)
    result = dense_matmul(a.reshape(1, -1) if a.ndim == 1 else a, b.reshape(-1, 1) if b.ndim == 1 else b,
                          transpose_b and b.ndim > 1)
    return finished(result.squeeze(-1) if b.ndim == 1 else result.squeeze(-2), gate, residual)

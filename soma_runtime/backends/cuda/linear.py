"""CUDA jets for matmul, embedding, rope and the KV-cache write.

Quantized weights stay in their format on the device (the 32-weight ones planar: see device.py)
and are decoded inside the kernels, 32 weights (one block, or one sub-block of a 256-weight K-quant
block) at a time. With `activations="q8"` (llama.cpp's scheme, as on CPU) q8_0/q4_0/q4_1 weights
meet q8-quantized activations in exact integer dots (int8 tensor cores, or dp4a for one row), one
scale multiply-add per block; so do q4_K/q5_K/q6_K weights, as in llama.cpp's CUDA kernels (the CPU keeps
their activations f32: 1B q4_K decode on an H200 went from 597 to 1459 tok/s). Otherwise blocks are
decoded to f32 and multiplied in f32 ("ieee": no tf32 rounding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import INTERPRET, DeviceQTensor, device_jet
from soma_runtime.backends.cuda.elementwise import BINARY, GELU_TANH, UNARY, activate, binary, gated_pairs, normalize, unary
from soma_runtime.ir.jets import jet

CUDA = "cuda"
F = ("f32", "f16", "bf16")
INT = ("i32", "i64")
INT8_FORMATS = (2, 3, 8)               # GGUF ids of the 32-weight formats (q4_0, q4_1, q8_0): planar
Q8_FORMATS = (*INT8_FORMATS, 12, 13, 14)   # ... and of q4_K, q5_K, q6_K: weights that meet q8 activations in integer dots
QUANTIZED = ("q4_0", "q4_1", "q8_0", "q4_K", "q5_K", "q6_K")
DP4A = tl.constexpr(not INTERPRET)        # the byte dot-product instruction, through inline PTX
BF16_DOT = tl.constexpr(not INTERPRET)
SIGN_BITS = tl.constexpr(-0x7F7F7F80)     # 0x80808080 as an int32
GEMV_ROWS = 4          # up to this many activation rows, a matrix-vector kernel per row (decode)
SKINNY_ROWS = 64       # ... up to this many, against bf16 weights, the decode-batch kernel
GEMV_TILES = {"short": (8, 512, 2), "long": (8, 1024, 4)}     # dense matrix-vector (BN, BK, warps) by K: < 8192 or more
GATES = {"swiglu": UNARY["silu"], "geglu_tanh": GELU_TANH}    # a gated epilogue's activation (`activate`'s kind)
NO_GATE = -1                                                   # ... none: the product as it is


@triton.jit
def _f16_at(ptr):
    """The f16 stored at byte pointers `ptr`, as f32: one 2-byte load (every scale and min is 2-byte
    aligned: the formats' blocks and rows have even sizes, planar rows are 16-byte padded)."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _scale_min(b0, b1, b2, sub):
    """Sub-block `sub`'s 6-bit scale and min (as f32) in a q4_K / q5_K superblock, from bytes u, 4 + u and
    8 + u of its 12 scale bytes, u = sub % 4 (ggml's get_scale_min_k4)."""
    scale = tl.where(sub < 4, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    low = tl.where(sub < 4, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return scale.to(tl.float32), low.to(tl.float32)


@triton.jit
def _decode_int8(rows, b, blocks, FMT: tl.constexpr):
    """Block b of each row (`rows`: byte pointers to row starts; rows and b broadcast to a shape S; the
    32-weight formats planar, q4_K as GGUF stores it) -> (q [S..., 32] int8, scale [S...], min [S...]):
    a weight is scale * q (+ min for q4_1 and q4_K)."""
    j = tl.arange(0, 32)
    if FMT == 12 or FMT == 13:                              # q4_K: d, dmin, 12 bytes of 6-bit scales/mins, 128 qs
        base = rows + (b // 8) * (144 if FMT == 12 else 176)   # q5_K: 32 bytes of high bits before the qs
        sub = b % 8
        sc, mn = _scale_min(tl.load(base + 4 + sub % 4), tl.load(base + 8 + sub % 4), tl.load(base + 12 + sub % 4), sub)
        byte = tl.load(tl.expand_dims(base + (16 if FMT == 12 else 48) + (sub // 2) * 32, -1) + j)
        q = (byte >> tl.expand_dims((sub % 2) * 4, -1)) & 15
        if FMT == 13:                                       # bit `sub` of high byte j: weight j's fifth bit
            q |= ((tl.load(tl.expand_dims(base + 16, -1) + j) >> tl.expand_dims(sub, -1)) & 1) << 4
        return q.to(tl.int8), _f16_at(base) * sc, -(_f16_at(base + 2) * mn)
    quant_bytes: tl.constexpr = 32 if FMT == 8 else 16
    scales = rows + blocks * quant_bytes + 2 * b
    d = _f16_at(scales)
    if FMT == 8:                                            # q8_0: 32 x int8
        q = tl.load(tl.expand_dims(rows + b * 32, -1) + j).to(tl.int8, bitcast=True)
        return q, d, d * 0.0
    byte = tl.load(tl.expand_dims(rows + b * 16, -1) + j % 16)
    q = ((byte >> ((j // 16) * 4)) & 15).to(tl.int8)        # low nibbles hold weights 0..15
    if FMT == 2:                                            # q4_0: q - 8
        return q - 8, d, d * 0.0
    return q, d, _f16_at(scales + 2 * blocks)               # q4_1: a min after the scales


@triton.jit
def _q6k_int8(rows, b, blocks):
    """Block b of planar q6_K rows (planes of 128 ql, 64 qh, 16 int8 scales, d per superblock; shapes as
    `_decode_int8`) -> (q - 32 [S..., 32] int8, the scale of weights 0..15, of 16..31 [S...])."""
    j = tl.arange(0, 32)
    superblock, sub, superblocks = b // 8, b % 8, blocks // 8
    half, quarter = sub // 4, sub % 4
    low = tl.load(tl.expand_dims(rows + superblock * 128 + 64 * half + 32 * (quarter % 2), -1) + j)
    high = tl.load(tl.expand_dims(rows + superblocks * 128 + superblock * 64 + 32 * half, -1) + j)
    q = ((low >> tl.expand_dims(4 * (quarter // 2), -1)) & 15) | (((high >> tl.expand_dims(2 * quarter, -1)) & 3) << 4)
    scales = (rows + superblocks * 192 + superblock * 16 + 8 * half + 2 * quarter).to(tl.pointer_type(tl.int8))
    d = _f16_at(rows + superblocks * 208 + superblock * 2)
    return (q.to(tl.int8) - 32, d * tl.load(scales).to(tl.float32), d * tl.load(scales + 1).to(tl.float32))


@triton.jit
def _decode_f32(rows, b, blocks, FMT: tl.constexpr):
    """Weights b*32 .. b*32+31 of each row, decoded to f32 [S..., 32] (shapes as `_decode_int8`)."""
    if FMT == 14:
        q, first, second = _q6k_int8(rows, b, blocks)
        return tl.where(tl.arange(0, 32) < 16, tl.expand_dims(first, -1), tl.expand_dims(second, -1)) * q.to(tl.float32)
    q, d, m = _decode_int8(rows, b, blocks, FMT)
    return tl.expand_dims(d, -1) * q.to(tl.float32) + tl.expand_dims(m, -1)


@triton.jit
def _round_half_even(v):
    r = tl.floor(v + 0.5)
    return tl.where((r - v == 0.5) & (r % 2 != 0), r - 1.0, r)


@chained
@triton.jit
def _quantize_q8_kernel(x_ptr, norm_ptr, q_ptr, d_ptr, s_ptr, blocks, eps, NORM: tl.constexpr):
    """One 32-block of one row: d = f16(amax / 127), q = rint(x * 127 / amax), s = f16(amax / 127 * sum q),
    as the CPU kernels (and ggml's x86 code) compute them; with NORM, of the rms-normalized row."""
    after_prior()
    row, b = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, 32)
    x = tl.load(x_ptr + row * blocks * 32 + b * 32 + j).to(tl.float32)
    if NORM:
        x = x * _inverse_rms(x_ptr + row * blocks * 32, blocks * 32, eps) * tl.load(norm_ptr + b * 32 + j).to(tl.float32)
    amax = tl.max(tl.abs(x), 0)
    inv = tl.where(amax != 0, 127.0 / amax, 0.0)
    q = _round_half_even(x * inv)
    scale = amax / 127.0
    tl.store(q_ptr + row * blocks * 32 + b * 32 + j, q.to(tl.int8))
    tl.store(d_ptr + row * blocks + b, scale.to(tl.float16).to(tl.float32))
    tl.store(s_ptr + row * blocks + b, (scale * tl.sum(q, 0)).to(tl.float16).to(tl.float32))


@triton.jit
def _inverse_rms(row_ptr, n, eps):
    """1 / sqrt(mean(x^2) + eps) of the n values at row_ptr, rounded as the CPU's rmsnorm (squares in
    f32 summed in f64, the rest correctly rounded in f32): the same values meet the q8 rounding."""
    i = tl.arange(0, 1024)
    total = tl.zeros((1024,), tl.float64)
    for start in tl.range(0, n, 1024):
        x = tl.load(row_ptr + start + i, mask=start + i < n, other=0.0).to(tl.float32)
        total += (x * x).to(tl.float64)
    mean = (tl.sum(total, 0) / n).to(tl.float32)
    return tl.div_rn(1.0, tl.sqrt_rn(mean + eps))


@chained
@triton.jit
def _qmatmul_kernel(x_ptr, xq_ptr, xd_ptr, xs_ptr, w_ptr, out_ptr, M, N, blocks, row_bytes,
                    FMT: tl.constexpr, Q8: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """out[M, N] = x[M, K] @ W[N, K]^T, W as GGUF rows of `row_bytes`; K = 32 * blocks."""
    after_prior()
    pm, pn = tl.program_id(0), tl.program_id(1)
    m = pm * BM + tl.arange(0, BM)
    n = pn * BN + tl.arange(0, BN)
    j = tl.arange(0, 32)
    m_ok, n_ok = m < M, n < N
    rows_ptr = w_ptr + tl.where(n_ok, n, 0).to(tl.int64) * row_bytes
    acc = tl.zeros((BM, BN), tl.float32)
    for b in tl.range(0, blocks):
        if Q8:
            xq = tl.load(xq_ptr + m[:, None] * blocks * 32 + b * 32 + j[None, :], mask=m_ok[:, None], other=0)
            xd = tl.load(xd_ptr + m * blocks + b, mask=m_ok, other=0.0)
            if FMT == 14:                                   # q6_K: a scale per 16 weights, so a dot per half
                wq, first, second = _q6k_int8(rows_ptr, b, blocks)
                lead = tl.dot(tl.where(j[None, :] < 16, xq, 0), tl.trans(wq), out_dtype=tl.int32).to(tl.float32)
                tail = tl.dot(tl.where(j[None, :] >= 16, xq, 0), tl.trans(wq), out_dtype=tl.int32).to(tl.float32)
                acc += xd[:, None] * (lead * first[None, :] + tail * second[None, :])
            else:
                wq, wd, wm = _decode_int8(rows_ptr, b, blocks, FMT)
                dot = tl.dot(xq, tl.trans(wq), out_dtype=tl.int32).to(tl.float32)
                acc += dot * (xd[:, None] * wd[None, :])
                if FMT == 3:
                    acc += tl.load(xs_ptr + m * blocks + b, mask=m_ok, other=0.0)[:, None] * wm[None, :]
                elif FMT == 12 or FMT == 13:                # q4_K's and q5_K's min times the block's exact sum
                    acc += (xd * tl.sum(xq.to(tl.int32), 1).to(tl.float32))[:, None] * wm[None, :]
        else:
            w = _decode_f32(rows_ptr, b, blocks, FMT)
            x = tl.load(x_ptr + m[:, None] * blocks * 32 + b * 32 + j[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _byte(words, t: tl.constexpr):
    """Byte t of int32 words, signed."""
    return (((words >> (8 * t)) & 255) ^ 128) - 128


@triton.jit
def _dot4(a, b, acc):
    """acc + the dot product of the four signed bytes of int32 words a and b: the dp4a instruction
    (emulated in the interpreter, which runs no inline assembly)."""
    a, b = tl.broadcast(a, b)
    if DP4A:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        for t in tl.static_range(4):
            acc += _byte(a, t) * _byte(b, t)
        return acc


@chained
@triton.jit
def _qgemv_kernel(x_ptr, xq_ptr, xd_ptr, xs_ptr, w_ptr, res_ptr, out_ptr, N, blocks, row_bytes, FMT: tl.constexpr,
                  Q8: tl.constexpr, HAS_RES: tl.constexpr, GATE: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
    """One activation row (program axis 1) times BN weight rows, NB blocks per step: decode reads
    the weights once and keeps many rows in flight (the bandwidth-bound case). The planar 32-block
    formats are read as 32-bit words of quants (16-byte loads), a step ahead: the first step's
    weights load while the kernel before still runs (measured this way only, unlike the dense
    GEMV, which lost with it); so are the K-quants' under q8 activations, NB chunks (of 64 / 128
    weights) a step. With a GATE, the rows come in (gate, up) pairs: BN / 2 activated results (one
    kernel fewer per layer: 1B q4_0 decode +4% on an H200)."""
    pn, m = tl.program_id(0), tl.program_id(1)
    n = pn * BN + tl.arange(0, BN)
    rows = w_ptr + tl.where(n < N, n, 0).to(tl.int64) * row_bytes                               # [BN]
    PLANAR: tl.constexpr = FMT == 2 or FMT == 3 or FMT == 8
    Q45K: tl.constexpr = Q8 and (FMT == 12 or FMT == 13)    # K-quants under q8 activations: chunks of 64 / 128 weights
    Q6K: tl.constexpr = Q8 and FMT == 14
    PER: tl.constexpr = 2 if Q45K else (4 if Q6K else 1)    # 32-blocks a chunk (else a block a step's unit)
    if PLANAR:
        words, d, mn = _planar_blocks(rows, 0, blocks, FMT, NB)
    elif Q45K:
        words, high, head, s0, s1, s2 = _k_chunks(rows, 0, blocks, FMT, NB)
    elif Q6K:
        low02, low13, high, s0, s1, d = _q6k_chunks(rows, 0, blocks, NB)
    after_prior()
    acc = tl.zeros((BN, NB), tl.float32)
    x_row, xq_row, xd_row = x_ptr + m * blocks * 32, xq_ptr + m * blocks * 32, xd_ptr + m * blocks
    for b0 in tl.range(0, blocks, PER * NB):
        b = b0 // PER + tl.arange(0, NB)
        b_ok = b < blocks // PER
        b = tl.where(b_ok, b, 0)
        if PLANAR:
            ahead = _planar_blocks(rows, b0 + NB, blocks, FMT, NB)
            part = _planar_dots(words, d, mn, b, x_row, xq_row, xd_row, xs_ptr + m * blocks, FMT, Q8)
            words, d, mn = ahead
        elif Q45K:
            ahead = _k_chunks(rows, b0 // 2 + NB, blocks, FMT, NB)
            part = _k_dots(words, high, head, s0, s1, s2, b, xq_row, xd_row, FMT)
            words, high, head, s0, s1, s2 = ahead
        elif Q6K:
            ahead = _q6k_chunks(rows, b0 // 4 + NB, blocks, NB)
            part = _q6k_dots(low02, low13, high, s0, s1, d, b, xq_row, xd_row)
            low02, low13, high, s0, s1, d = ahead
        else:
            w = _decode_f32(tl.expand_dims(rows, 1), tl.expand_dims(b, 0), blocks, FMT)              # [BN, NB, 32]
            x = tl.load(x_row + tl.expand_dims(b, 1) * 32 + tl.arange(0, 32)).to(tl.float32)
            part = tl.sum(w * tl.expand_dims(x, 0), 2)
        acc += tl.where(tl.expand_dims(b_ok, 0), part, 0.0)
    _store_products(out_ptr, res_ptr, m, N, pn, tl.sum(acc, 1), HAS_RES, GATE, BN)


@triton.jit
def _planar_blocks(rows, b0, blocks, FMT: tl.constexpr, NB: tl.constexpr):
    """Blocks b0 .. b0+NB-1 of planar rows [BN] (none past the last): their quants as 32-bit words
    [BN, NB, words], their scales [BN, NB] and q4_1's mins (else the scales again)."""
    words_per_block: tl.constexpr = 8 if FMT == 8 else 4
    b = b0 + tl.arange(0, NB)
    b_ok = b < blocks
    at = tl.expand_dims(b, 1) * words_per_block + tl.arange(0, words_per_block)                      # [NB, words]
    words = tl.load(rows.to(tl.pointer_type(tl.int32))[:, None, None] + at[None, :, :], mask=b_ok[None, :, None], other=0)
    scales = (tl.expand_dims(rows, 1) + blocks * 4 * words_per_block + 2 * tl.expand_dims(b, 0)).to(tl.pointer_type(tl.float16))
    d = tl.load(scales, mask=b_ok[None, :], other=0.0).to(tl.float32)
    mn = d
    if FMT == 3:                                            # q4_1: its mins follow the scales
        mn = tl.load(scales + blocks, mask=b_ok[None, :], other=0.0).to(tl.float32)
    return words, d, mn


@triton.jit
def _planar_dots(words, d, mn, b, x_row, xq_row, xd_row, xs_row, FMT: tl.constexpr, Q8: tl.constexpr):
    """Blocks b [NB] of the rows (`_planar_blocks`' words, scales, mins) dotted with one activation row
    -> [BN, NB]: under q8 activations four weights meet four activations in one dp4a, exact, one
    scale per block; else the weights' integers meet f32 activations."""
    words_per_block: tl.constexpr = 8 if FMT == 8 else 4
    c = tl.arange(0, words_per_block)
    if FMT == 8:                                            # 4 weights as 4 signed bytes per word
        low, high = words, words
    else:                                                   # a word's low nibbles are weights 4c..4c+3, its high ones 16 later
        low, high = words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F
        if FMT == 2:                                        # q4_0: each byte minus 8
            low, high = (low + 0x78787878) ^ SIGN_BITS, (high + 0x78787878) ^ SIGN_BITS
    if Q8:
        xw = xq_row.to(tl.pointer_type(tl.int32)) + tl.expand_dims(b, 1) * 8
        if FMT == 8:
            dots = _dot4(words, tl.expand_dims(tl.load(xw + c), 0), tl.zeros(words.shape, tl.int32))
        else:
            dots = _dot4(low, tl.expand_dims(tl.load(xw + c), 0), tl.zeros(words.shape, tl.int32))
            dots = _dot4(high, tl.expand_dims(tl.load(xw + 4 + c), 0), dots)
        part = tl.sum(dots, 2).to(tl.float32) * d * tl.expand_dims(tl.load(xd_row + b), 0)
        if FMT == 3:
            part += mn * tl.expand_dims(tl.load(xs_row + b), 0)
    else:
        part = d * _float_dots(low, high, x_row, b, FMT)
        if FMT == 3:
            part += mn * tl.expand_dims(tl.sum(tl.load(x_row + tl.expand_dims(b, 1) * 32 + tl.arange(0, 32)), 1), 0)
    return part


@triton.jit
def _k_chunks(rows, c0, blocks, FMT: tl.constexpr, NB: tl.constexpr):
    """Chunks c0 .. c0+NB-1 of q4_K / q5_K rows [BN] (64 weights each, a quarter of a 144- / 176-byte
    superblock; none past the last), as 32-bit words (superblocks are 16-byte aligned): quants
    [BN, NB, 8], q5_K's high bits [BN, NB, 8] (else the quants again), and the chunk's superblock's
    (d, dmin) word and three words of 6-bit scales and mins [BN, NB]."""
    c = c0 + tl.arange(0, NB)
    ok = tl.expand_dims(c < blocks // 2, 0)
    base = tl.expand_dims(rows, 1) + tl.expand_dims((c // 4) * (144 if FMT == 12 else 176), 0)       # superblocks [BN, NB]
    quants = (base + (16 if FMT == 12 else 48) + 32 * tl.expand_dims(c % 4, 0)).to(tl.pointer_type(tl.int32))
    words = tl.load(quants[:, :, None] + tl.arange(0, 8)[None, None, :], mask=ok[:, :, None], other=0)
    head = base.to(tl.pointer_type(tl.int32))
    high = words
    if FMT == 13:
        high = tl.load((head + 4)[:, :, None] + tl.arange(0, 8)[None, None, :], mask=ok[:, :, None], other=0)
    return (words, high, tl.load(head, mask=ok, other=0), tl.load(head + 1, mask=ok, other=0),
            tl.load(head + 2, mask=ok, other=0), tl.load(head + 3, mask=ok, other=0))


@triton.jit
def _q8_words(xq_row, xd_row, block):
    """q8 activation blocks `block` [NB]: their quants as words [NB, 8], the sums of each word's four
    bytes [NB, 8], and their scales [NB]."""
    xw = tl.load(xq_row.to(tl.pointer_type(tl.int32)) + tl.expand_dims(block, 1) * 8 + tl.arange(0, 8))
    sums = _dot4(xw, tl.full(xw.shape, 0x01010101, tl.int32), tl.zeros(xw.shape, tl.int32))
    return xw, sums, tl.load(xd_row + block)


@triton.jit
def _k_dots(words, high, head, s0, s1, s2, c, xq_row, xd_row, FMT: tl.constexpr):
    """Chunks c [NB] of q4_K / q5_K rows (`_k_chunks`' words) dotted with q8 activations -> [BN, NB]. A
    chunk's word l holds weights 4l..4l+3 of its first 32-weight sub-block in low nibbles, of its second
    in high ones (q5_K: their fifth bits are bits 2 (c % 4) and 2 (c % 4) + 1 of high word l's bytes); a
    sub-block's weights are d * scale * q - dmin * min, so its dot is d * scale * xd * sum(q xq) - dmin
    * min * xd * sum(xq), both sums exact integer dots (dp4a): the product of the q8-rounded row."""
    d = (head & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (head >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    total = tl.zeros(head.shape, tl.float32)
    for h in tl.static_range(2):
        sub = tl.expand_dims(2 * (c % 4) + h, 0)                                                     # [1, NB]: 0..7
        shift = 8 * (sub % 4)
        scale, low = _scale_min((s0 >> shift) & 255, (s1 >> shift) & 255, (s2 >> shift) & 255, sub)
        xw, sums, xd = _q8_words(xq_row, xd_row, 2 * c + h)
        q = (words >> (4 * h)) & 0x0F0F0F0F
        if FMT == 13:
            q |= ((high >> tl.expand_dims(sub, 2)) & 0x01010101) << 4
        dots = tl.sum(_dot4(q, tl.expand_dims(xw, 0), tl.zeros(words.shape, tl.int32)), 2)
        total += d * scale * (dots.to(tl.float32) * tl.expand_dims(xd, 0)) - dmin * low * tl.expand_dims(tl.sum(sums, 1).to(tl.float32) * xd, 0)
    return total


@triton.jit
def _q6k_chunks(rows, c0, blocks, NB: tl.constexpr):
    """Chunks c0 .. c0+NB-1 of planar q6_K rows [BN] (128 weights each, half a superblock; none past the
    last) as 32-bit words: low-bit quants of its sub-blocks 0 and 2, then 1 and 3 [BN, NB, 8] each, the
    high bits [BN, NB, 8], two words of int8 scales, and d [BN, NB]."""
    c = c0 + tl.arange(0, NB)
    ok = tl.expand_dims(c < blocks // 4, 0)
    superblocks = blocks // 8
    start = tl.expand_dims(rows, 1)
    low = (start + tl.expand_dims(c * 64, 0)).to(tl.pointer_type(tl.int32))[:, :, None] + tl.arange(0, 8)[None, None, :]
    high = (start + superblocks * 128 + tl.expand_dims(c * 32, 0)).to(tl.pointer_type(tl.int32))[:, :, None] + tl.arange(0, 8)[None, None, :]
    scales = (start + superblocks * 192 + tl.expand_dims(c * 8, 0)).to(tl.pointer_type(tl.int32))
    d = (start + superblocks * 208 + tl.expand_dims((c // 2) * 2, 0)).to(tl.pointer_type(tl.float16))
    return (tl.load(low, mask=ok[:, :, None], other=0), tl.load(low + 8, mask=ok[:, :, None], other=0),
            tl.load(high, mask=ok[:, :, None], other=0), tl.load(scales, mask=ok, other=0), tl.load(scales + 1, mask=ok, other=0),
            tl.load(d, mask=ok, other=0.0).to(tl.float32))


@triton.jit
def _q6k_dots(low02, low13, high, s0, s1, d, c, xq_row, xd_row):
    """Chunks c [NB] of q6_K rows (`_q6k_chunks`' words) dotted with q8 activations -> [BN, NB]. Sub-block
    j's weights are d * scale * (q - 32), q 6 bits (4 low, 2 high), a scale for each 16: per word of four
    weights, scale * (dp4a(q, xq) - 32 * sum(xq)), all in exact integers until d * xd."""
    m = tl.arange(0, 8)
    total = tl.zeros(d.shape, tl.float32)
    for j in tl.static_range(4):
        if j % 2 == 0:
            low = low02
        else:
            low = low13
        q = ((low >> (4 * (j // 2))) & 0x0F0F0F0F) | (((high >> (2 * j)) & 0x03030303) << 4)          # [BN, NB, 8]
        if j // 2 == 0:
            words = s0
        else:
            words = s1
        scale = _byte(tl.expand_dims(words, 2) >> (8 * (2 * (j % 2) + m // 4)), 0)                      # [BN, NB, 8]
        xw, sums, xd = _q8_words(xq_row, xd_row, 4 * c + j)
        v = _dot4(q, tl.expand_dims(xw, 0), tl.zeros(q.shape, tl.int32)) - 32 * tl.expand_dims(sums, 0)
        total += d * tl.expand_dims(xd, 0) * tl.sum(v * scale, 2).to(tl.float32)
    return total


@triton.jit
def _float_dots(low, high, x_ptr, b, FMT: tl.constexpr):
    """Per block, the weights' integers (bytes of `low`/`high` [BN, NB, words]) times f32 activations."""
    words_per_block: tl.constexpr = 8 if FMT == 8 else 4
    at = tl.expand_dims(b, 1) * 32 + 4 * tl.arange(0, words_per_block)                             # [NB, words]
    total = tl.zeros(low.shape, tl.float32)
    for t in tl.static_range(4):
        total += _byte(low, t).to(tl.float32) * tl.expand_dims(tl.load(x_ptr + at + t), 0).to(tl.float32)
        if FMT != 8:
            total += _byte(high, t).to(tl.float32) * tl.expand_dims(tl.load(x_ptr + at + 16 + t), 0).to(tl.float32)
    return tl.sum(total, 2)


@triton.jit
def _store_products(out_ptr, res_ptr, m, N, pn, y, HAS_RES: tl.constexpr, GATE: tl.constexpr, BN: tl.constexpr):
    """Program pn's BN products y of activation row m (of N) stored; with a GATE, rows (and products)
    come in (gate, up) pairs: BN / 2 activated results, of N / 2."""
    PAIRS: tl.constexpr = 1 if GATE < 0 else 2
    if GATE >= 0:
        gate, up = tl.split(tl.reshape(y, (BN // 2, 2)))
        y = activate(gate, GATE, 0.0) * up
    _store_row(out_ptr, res_ptr, m, N // PAIRS, pn * (BN // PAIRS) + tl.arange(0, BN // PAIRS), y, HAS_RES)


@triton.jit
def _store_row(out_ptr, res_ptr, m, width, n, y, HAS_RES: tl.constexpr):
    """Matrix-vector results y, columns n of row m (of `width`), stored in the output's dtype, the
    residual added first if there is one."""
    keep = n < width
    at = m * width + n
    if HAS_RES:
        y += tl.load(res_ptr + at, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=keep)


@chained
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, g_ptr, res_ptr, out_ptr, N, K, swn, swk, eps, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                 GATE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One activation row times BN dense weight rows (any float type, read once, f32 math). With NORM,
    of the row rms-normalized by weight g: the products of x * g, scaled by the row's 1/rms, whose
    squares are summed in the same pass; with a GATE, over (gate, up) row pairs (8B bf16 decode on an
    H200: 222.6 -> 227.0 tok/s). (Loading each step's weights a step ahead, the first before the wait,
    cost 3% at 1B and 8% at 8B; so did a bulk L2 prefetch of a program's rows before the wait, 14% and
    21%.)"""
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
    _store_products(out_ptr, res_ptr, m, N, pn, y, HAS_RES, GATE, BN)


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
        a = tl.load(a_ptr + batch * sab + m[:, None] * sam + k[None, :] * sak, mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + batch * sbb + n[:, None] * sbn + k[None, :] * sbk, mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
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
        # a step's products sum apart, then join in one rounded f32 add: a long chain of tensor-core
        # accumulations (which truncate) lost 20x f32's accuracy at K = 4096 on the H200
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


def with_residual(out: torch.Tensor, residual):
    return out if residual is None else binary(out, residual, BINARY["add"])


def finished(y: torch.Tensor, gate: int, residual) -> torch.Tensor:
    """A product outside the matrix-vector kernels, gated (interleaved column pairs) and joined to the residual."""
    return with_residual(y if gate == NO_GATE else gated_pairs(y, gate), residual)


def gemv_residual(residual, like: torch.Tensor) -> torch.Tensor:
    """The residual as the matrix-vector kernels read it: [rows, N], contiguous (else `like`, unread)."""
    return like if residual is None else residual.reshape(like.shape).contiguous()


def normalized(rows: torch.Tensor, norm) -> torch.Tensor:
    """rmsnorm(rows) with norm = (weight, eps), for the kernels that do not fold it in (None: as is)."""
    return rows if norm is None else normalize(rows, norm[0], None, norm[1], center=False)


def quantized_matmul(x: torch.Tensor, w: DeviceQTensor, q8: bool, residual=None, norm=None, gate=NO_GATE) -> torch.Tensor:
    fmt = w.dtype.ggml_id
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = rows.shape
    N, blocks = w.shape[0], K // 32
    use_q8 = q8 and fmt in Q8_FORMATS
    if use_q8:                                              # the norm folds into the quantization
        xq = torch.empty((M, K), dtype=torch.int8, device=x.device)
        xd, xs = (torch.empty((M, blocks), dtype=torch.float32, device=x.device) for _ in range(2))
        _quantize_q8_kernel[(M, blocks)](rows, rows if norm is None else norm[0], xq, xd, xs, blocks,
                                         0.0 if norm is None else float(norm[1]), NORM=norm is not None)
    else:
        rows = normalized(rows, norm)
        xq = xd = xs = rows
    if M <= GEMV_ROWS:
        # swept on an H200 (1B and 8B shapes, L2 cold): 32-blocks, 64 blocks a step, four rows per two-warp
        # program (one per one-warp program for long rows); K-quants under q8, 16 chunks a step, four rows
        # per program, one warp for q4_K (q5_K untimed, alike), four for q6_K (long rows: one row, one warp,
        # 32 / 16 chunks); in
        # f32, wider programs, and narrow layers more, smaller programs; a gated product's program takes at
        # least one (gate, up) pair
        if fmt in INT8_FORMATS:
            BN, NB, warps = (1, 64, 1) if K >= 8192 else (4, 64, 2)
        elif use_q8:
            BN, NB, warps = ((1, 32, 1) if K >= 8192 else (4, 16, 1)) if fmt != 14 else ((1, 16, 1) if K >= 8192 else (4, 16, 4))
        else:
            BN, NB, warps = 16 if N >= 8192 else 4, 8, 4
        BN = BN if gate == NO_GATE else max(BN, 2)
        out = torch.empty((M, N if gate == NO_GATE else N // 2), dtype=x.dtype, device=x.device)
        _qgemv_kernel[(triton.cdiv(N, BN), M)](rows, xq, xd, xs, w.data, gemv_residual(residual, out), out, N, blocks,
                                               w.data.shape[1], FMT=fmt, Q8=use_q8, HAS_RES=residual is not None, GATE=gate,
                                               BN=BN, NB=NB, num_warps=warps)
        return out.reshape(*x.shape[:-1], out.shape[1])
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BM, BN = 16, 32 if fmt in INT8_FORMATS and not use_q8 else 64      # (q4_1, q8_0 blocks decoded to f32 spilled at 64)
    _qmatmul_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](rows, xq, xd, xs, w.data, out, M, N, blocks,
                                                                w.data.shape[1], FMT=fmt, Q8=use_q8, BM=BM, BN=BN)
    return finished(out.reshape(*x.shape[:-1], N), gate, residual)


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
    _skinny_matmul_kernel[(triton.cdiv(N, BN), split)](rows, w, parts, M, N, K, w.stride(0), BN=BN, BM=max(16, triton.next_power_of_2(M)),
                                                      BK=BK, SPLIT=split, num_warps=warps, num_stages=stages)
    join = residual if split > 1 and gate == NO_GATE else None      # added as the K splits sum (a gate comes first)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](parts, gemv_residual(join, out), out, M * N, SPLIT=split,
                                                       HAS_RES=join is not None, BLOCK=1024)
    return finished(out, gate, None if join is not None else residual)


def dense_matmul(a: torch.Tensor, b: torch.Tensor, transpose_b: bool, residual=None, norm=None, gate=NO_GATE) -> torch.Tensor:
    bt = b if transpose_b else b.transpose(-1, -2)           # [..., N, K] either way, as strides
    if bt.ndim == 2 and a.numel() // a.shape[-1] <= GEMV_ROWS:
        rows = a.reshape(-1, a.shape[-1]).contiguous()
        N, K = bt.shape
        out = torch.empty((rows.shape[0], N if gate == NO_GATE else N // 2), dtype=a.dtype, device=a.device)
        # swept on an H200 (1B and 8B shapes, chained, L2 cold): eight rows per program, 512-wide steps
        # (1024 and four warps for long rows); with the norm folded in, 3.8-4.1 TB/s read on the large layers
        BN, BK, warps = GEMV_TILES["long" if K >= 8192 else "short"]
        _gemv_kernel[(triton.cdiv(N, BN), rows.shape[0])](rows, bt, rows if norm is None else norm[0], gemv_residual(residual, out),
                                                          out, N, K, bt.stride(0), bt.stride(1), 0.0 if norm is None else float(norm[1]),
                                                          NORM=norm is not None, HAS_RES=residual is not None, GATE=gate, BN=BN, BK=BK,
                                                          num_warps=warps)
        return out.reshape(*a.shape[:-1], out.shape[1])
    if norm is not None:
        a = normalized(a.contiguous(), norm)
    if bt.ndim == 2 and a.dtype == torch.float32 and bt.dtype == torch.bfloat16 and bt.stride(1) == 1 and a.numel() // a.shape[-1] <= SKINNY_ROWS:
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


@chained
@triton.jit
def _embedding_kernel(table_ptr, ids_ptr, out_ptr, dim, row_bytes, FMT: tl.constexpr, DENSE: tl.constexpr):
    """Row ids[r], 32 columns per program: dense tables copy, quantized ones decode."""
    after_prior()
    r, b = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, 32)
    row = tl.load(ids_ptr + r).to(tl.int64)
    if DENSE:
        keep = b * 32 + j < dim
        value = tl.load(table_ptr + row * dim + b * 32 + j, mask=keep)
        tl.store(out_ptr + r * dim + b * 32 + j, value.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        rows_ptr = table_ptr + row * row_bytes + tl.zeros((1,), tl.int64)
        value = tl.reshape(_decode_f32(rows_ptr, b, dim // 32, FMT), (32,))
        tl.store(out_ptr + r * dim + b * 32 + j, value)


@jet("embedding", CUDA, [(F, INT)] + [(q, INT) for q in QUANTIZED])
@device_jet
def embedding(table, ids):
    flat = ids.reshape(-1).contiguous()
    dim = table.shape[-1]
    dense = not isinstance(table, DeviceQTensor)
    out = torch.empty((flat.numel(), dim), dtype=table.dtype if dense else torch.float32, device=flat.device)
    data = table.contiguous() if dense else table.data
    _embedding_kernel[(flat.numel(), triton.cdiv(dim, 32))](data, flat, out, dim, 0 if dense else data.shape[1],
                                                             FMT=0 if dense else table.dtype.ggml_id, DENSE=dense)
    return out.reshape(*ids.shape, dim)


@triton.jit
def rotated(row_ptr, d, value, keep, position, freq_ptr, half, NEOX: tl.constexpr):
    """Rope on values already loaded from one head's row (`d`: their dims): each rotary dim meets its
    pair partner (i + half under neox, else the neighbour), loaded here; dims past 2 * half pass."""
    rotary = d < 2 * half
    if NEOX:
        first, f = d < half, d % half
        partner = tl.where(first, d + half, d - half)
    else:
        first, f = d % 2 == 0, d // 2
        partner = d ^ 1
    other = tl.load(row_ptr + partner, mask=keep & rotary, other=0.0).to(tl.float32)
    angle = position * tl.load(freq_ptr + f, mask=rotary, other=0.0)        # by dim only: shared by a tile's rows
    turned = value * tl.cos(angle) + tl.where(first, -other, other) * tl.sin(angle)
    return tl.where(keep & rotary, turned, value)


@chained
@triton.jit
def _rope_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, heads, dim, half, NEOX: tl.constexpr, BLOCK: tl.constexpr):
    """One (position, head) row of x [rows, heads, dim], rotated (see `rotated`)."""
    after_prior()
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    keep = d < dim
    value = tl.load(x_ptr + row * dim + d, mask=keep, other=0.0).to(tl.float32)
    position = tl.load(pos_ptr + row // heads).to(tl.float32)
    turned = rotated(x_ptr + row * dim, d, value, keep, position, freq_ptr, half, NEOX)
    tl.store(out_ptr + row * dim + d, turned.to(out_ptr.dtype.element_ty), mask=keep)


@jet("rope", CUDA, [(F, INT, "f32")])
@device_jet
def rope(x, positions, inv_freq, style="neox"):
    x = x.contiguous()
    heads, dim = x.shape[-2], x.shape[-1]
    positions = positions.expand(x.shape[:-2]).contiguous()
    out = torch.empty_like(x)
    half = inv_freq.shape[0]
    _rope_kernel[(x.numel() // dim,)](x, positions, inv_freq.contiguous(), out, heads, dim, half, NEOX=style == "neox",
                                      BLOCK=triton.next_power_of_2(dim))
    return out


@triton.jit
def _append_rows(pages_ptr, new_ptr, r, i, slot, pos_ptr, freq_ptr, width, dim, half, ROPE: tl.constexpr, NEOX: tl.constexpr):
    """Columns i of row r of `new` into its cache slot (rotated first with ROPE: a key)."""
    keep = i < width
    value = tl.load(new_ptr + r * width + i, mask=keep).to(tl.float32)
    if ROPE:
        position = tl.load(pos_ptr + r).to(tl.float32)
        value = rotated(new_ptr + r * width + (i - i % dim), i % dim, value, keep, position, freq_ptr, half, NEOX)
    tl.store(pages_ptr + slot * width + i, value.to(pages_ptr.dtype.element_ty), mask=keep)


@chained
@triton.jit
def _kv_append_kernel(pages_ptr, new_ptr, v_pages_ptr, v_new_ptr, slots_ptr, pos_ptr, freq_ptr, width, dim, half,
                      ROPE: tl.constexpr, NEOX: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, part, which): columns part*BLOCK.. of row r, of the keys (which 0) or the values (1)."""
    after_prior()
    r, part = tl.program_id(0), tl.program_id(1)
    i = part * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    if tl.program_id(2) == 0:
        _append_rows(pages_ptr, new_ptr, r, i, slot, pos_ptr, freq_ptr, width, dim, half, ROPE, NEOX)
    else:
        _append_rows(v_pages_ptr, v_new_ptr, r, i, slot, pos_ptr, freq_ptr, width, dim, half, False, NEOX)


ROPE_INPUTS = ((INT, "f32"), ("none", "none"))      # an op's fused rope: positions and inv_freq, or neither
KV_APPENDS = [(F, F, INT, *r) for r in ROPE_INPUTS] + [(c, "f32", INT, *r) for c in ("f16", "bf16") for r in ROPE_INPUTS]


@jet("kv_append", CUDA, [(*keys, *values) for keys in KV_APPENDS for values in (("none", "none"), keys[:2])])
@device_jet
def kv_append(pages, new, slots, positions=None, inv_freq=None, v_pages=None, v_new=None, style="neox"):
    """Rows of `new` into their cache slots, in place (rotated first, given rope's inputs), and the
    values' rows into theirs in the same launch if given; the caches themselves are the result."""
    width = pages.shape[2] * pages.shape[3]
    flat_slots = slots.reshape(-1).contiguous()
    rows = new.reshape(-1, width).contiguous()
    values = rows if v_new is None else v_new.reshape(-1, width).contiguous()
    rope = positions is not None
    _kv_append_kernel[(rows.shape[0], triton.cdiv(width, 256), 1 if v_pages is None else 2)](
        pages, rows, pages if v_pages is None else v_pages, values, flat_slots,
        positions.expand(new.shape[:-2]).contiguous() if rope else flat_slots, inv_freq.contiguous() if rope else rows, width,
        pages.shape[3], inv_freq.shape[0] if rope else 0, ROPE=rope, NEOX=style == "neox", BLOCK=256)
    return pages if v_pages is None else (pages, v_pages)

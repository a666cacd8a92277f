"""Matmuls with quantized weights, kept in their format on the device and decoded inside the kernels
(blocks.py). With `activations="q8"` (llama.cpp's scheme, as on CPU) q8_0/q4_0/q4_1 weights meet
q8-quantized activations in exact integer dots (int8 tensor cores, or dp4a for one row), one scale
multiply-add per block; so do q4_K/q5_K/q6_K weights, as in llama.cpp's CUDA kernels (the CPU keeps
their activations f32; on the GPU the integer dots are over twice as fast). Otherwise blocks are
decoded to f32 and multiplied in f32 ("ieee": no tf32 rounding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.blocks import Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, decode_f32, decode_int8, q6k_int8, scale_min
from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import INTERPRET, DeviceQTensor
from soma_runtime.backends.cuda.fused import NO_GATE, finished, gemv_residual, normalized, store_products

INT8_FORMATS = (Q4_0.value, Q4_1.value, Q8_0.value)           # the 32-weight formats: planar
Q8_FORMATS = (*INT8_FORMATS, Q4_K.value, Q5_K.value, Q6_K.value)   # ... and the K-quants that meet q8 activations in integer dots
DP4A = tl.constexpr(not INTERPRET)        # the byte dot-product instruction, through inline PTX
SIGN_BITS = tl.constexpr(-0x7F7F7F80)     # 0x80808080 as an int32
GEMV_ROWS = 4          # up to this many activation rows, a matrix-vector kernel per row (decode)
ROW_READ = 8192        # a normed row up to this wide is quantized by one program; longer ones are read this much a round


@triton.jit
def _round_half_even(v):
    r = tl.floor(v + 0.5)
    return tl.where((r - v == 0.5) & (r % 2 != 0), r - 1.0, r)


@chained
@triton.jit
def _quantize_q8_kernel(x_ptr, norm_ptr, q_ptr, d_ptr, s_ptr, blocks, eps, NORM: tl.constexpr, ROW: tl.constexpr,
                        BPP: tl.constexpr, WHOLE: tl.constexpr):
    """BPP 32-blocks of one row: d = f16(amax / 127), q = rint(x * 127 / amax), s = f16(amax / 127 * sum q),
    as the CPU kernels (and ggml's x86 code) compute them; with NORM, of the rms-normalized row: WHOLE,
    one program holds the row and takes its 1/rms from the values it quantizes (rather than each
    one-block program reading the row again); else read ROW values a round of loads. A plain row keeps
    a program per block (one program for it all is slower)."""
    row, p = tl.program_id(0), tl.program_id(1)
    b = p * BPP + tl.arange(0, BPP)
    at = b[:, None] * 32 + tl.arange(0, 32)[None, :]                  # [BPP, 32]
    ok = (b < blocks)[:, None]
    g = tl.full((BPP, 32), 1.0, tl.float32)
    if NORM:                                                # a weight: loaded before the wait
        g = tl.load(norm_ptr + at, mask=ok, other=0.0).to(tl.float32)
    after_prior()
    x = tl.load(x_ptr + row * blocks * 32 + at, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        if WHOLE:                                           # the whole row is here
            squares = tl.sum(tl.sum((x * x).to(tl.float64), 1), 0)
        else:
            squares = _row_squares(x_ptr + row * blocks * 32, blocks * 32, ROW)
        x = x * _inverse_rms(squares, blocks * 32, eps) * g
    amax = tl.max(tl.abs(x), 1)
    inv = tl.where(amax != 0, 127.0 / amax, 0.0)
    q = _round_half_even(x * inv[:, None])
    scale = amax / 127.0
    tl.store(q_ptr + row * blocks * 32 + at, q.to(tl.int8), mask=ok)
    tl.store(d_ptr + row * blocks + b, scale.to(tl.float16).to(tl.float32), mask=b < blocks)
    tl.store(s_ptr + row * blocks + b, (scale * tl.sum(q, 1)).to(tl.float16).to(tl.float32), mask=b < blocks)


@triton.jit
def _row_squares(row_ptr, n, ROW: tl.constexpr):
    """The sum of the squares of the n values at row_ptr, ROW at a time: squares in f32, summed in f64."""
    i = tl.arange(0, ROW)
    total = tl.zeros((ROW,), tl.float64)
    for start in tl.range(0, n, ROW):
        x = tl.load(row_ptr + start + i, mask=start + i < n, other=0.0).to(tl.float32)
        total += (x * x).to(tl.float64)
    return tl.sum(total, 0)


@triton.jit
def _inverse_rms(squares, n, eps):
    """1 / sqrt(mean(x^2) + eps) from the f64 sum of n f32 squares, rounded as the CPU's rmsnorm (the rest
    correctly rounded in f32): the same values meet the q8 rounding."""
    return tl.div_rn(1.0, tl.sqrt_rn((squares / n).to(tl.float32) + eps))


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
            if FMT == Q6_K:                                   # q6_K: a scale per 16 weights, so a dot per half
                wq, first, second = q6k_int8(rows_ptr, b, blocks)
                lead = tl.dot(tl.where(j[None, :] < 16, xq, 0), tl.trans(wq), out_dtype=tl.int32).to(tl.float32)
                tail = tl.dot(tl.where(j[None, :] >= 16, xq, 0), tl.trans(wq), out_dtype=tl.int32).to(tl.float32)
                acc += xd[:, None] * (lead * first[None, :] + tail * second[None, :])
            else:
                wq, wd, wm = decode_int8(rows_ptr, b, blocks, FMT)
                dot = tl.dot(xq, tl.trans(wq), out_dtype=tl.int32).to(tl.float32)
                acc += dot * (xd[:, None] * wd[None, :])
                if FMT == Q4_1:
                    acc += tl.load(xs_ptr + m * blocks + b, mask=m_ok, other=0.0)[:, None] * wm[None, :]
                elif FMT == Q4_K or FMT == Q5_K:                # q4_K's and q5_K's min times the block's exact sum
                    acc += (xd * tl.sum(xq.to(tl.int32), 1).to(tl.float32))[:, None] * wm[None, :]
        else:
            w = decode_f32(rows_ptr, b, blocks, FMT)
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
    weights load while the kernel before still runs (here it pays, unlike the dense GEMV); so are the
    K-quants' under q8 activations, NB chunks (of 64 / 128 weights) a step. With a GATE, the rows come
    in (gate, up) pairs: BN / 2 activated results (one kernel fewer per layer)."""
    pn, m = tl.program_id(0), tl.program_id(1)
    n = pn * BN + tl.arange(0, BN)
    rows = w_ptr + tl.where(n < N, n, 0).to(tl.int64) * row_bytes                               # [BN]
    PLANAR: tl.constexpr = FMT == Q4_0 or FMT == Q4_1 or FMT == Q8_0
    Q45K: tl.constexpr = Q8 and (FMT == Q4_K or FMT == Q5_K)    # K-quants under q8 activations: chunks of 64 / 128 weights
    Q6K: tl.constexpr = Q8 and FMT == Q6_K
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
            w = decode_f32(tl.expand_dims(rows, 1), tl.expand_dims(b, 0), blocks, FMT)              # [BN, NB, 32]
            x = tl.load(x_row + tl.expand_dims(b, 1) * 32 + tl.arange(0, 32)).to(tl.float32)
            part = tl.sum(w * tl.expand_dims(x, 0), 2)
        acc += tl.where(tl.expand_dims(b_ok, 0), part, 0.0)
    store_products(out_ptr, res_ptr, m, N, pn, tl.sum(acc, 1), HAS_RES, GATE, BN)


@triton.jit
def _planar_blocks(rows, b0, blocks, FMT: tl.constexpr, NB: tl.constexpr):
    """Blocks b0 .. b0+NB-1 of planar rows [BN] (none past the last): their quants as 32-bit words
    [BN, NB, words], their scales [BN, NB] and q4_1's mins (else the scales again)."""
    words_per_block: tl.constexpr = 8 if FMT == Q8_0 else 4
    b = b0 + tl.arange(0, NB)
    b_ok = b < blocks
    at = tl.expand_dims(b, 1) * words_per_block + tl.arange(0, words_per_block)                      # [NB, words]
    words = tl.load(rows.to(tl.pointer_type(tl.int32))[:, None, None] + at[None, :, :], mask=b_ok[None, :, None], other=0)
    scales = (tl.expand_dims(rows, 1) + blocks * 4 * words_per_block + 2 * tl.expand_dims(b, 0)).to(tl.pointer_type(tl.float16))
    d = tl.load(scales, mask=b_ok[None, :], other=0.0).to(tl.float32)
    mn = d
    if FMT == Q4_1:                                            # q4_1: its mins follow the scales
        mn = tl.load(scales + blocks, mask=b_ok[None, :], other=0.0).to(tl.float32)
    return words, d, mn


@triton.jit
def _planar_dots(words, d, mn, b, x_row, xq_row, xd_row, xs_row, FMT: tl.constexpr, Q8: tl.constexpr):
    """Blocks b [NB] of the rows (`_planar_blocks`' words, scales, mins) dotted with one activation row
    -> [BN, NB]: under q8 activations four weights meet four activations in one dp4a, exact, one
    scale per block; else the weights' integers meet f32 activations."""
    words_per_block: tl.constexpr = 8 if FMT == Q8_0 else 4
    c = tl.arange(0, words_per_block)
    if FMT == Q8_0:                                            # 4 weights as 4 signed bytes per word
        low, high = words, words
    else:                                                   # a word's low nibbles are weights 4c..4c+3, its high ones 16 later
        low, high = words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F
        if FMT == Q4_0:                                        # q4_0: each byte minus 8
            low, high = (low + 0x78787878) ^ SIGN_BITS, (high + 0x78787878) ^ SIGN_BITS
    if Q8:
        xw = xq_row.to(tl.pointer_type(tl.int32)) + tl.expand_dims(b, 1) * 8
        if FMT == Q8_0:
            dots = _dot4(words, tl.expand_dims(tl.load(xw + c), 0), tl.zeros(words.shape, tl.int32))
        else:
            dots = _dot4(low, tl.expand_dims(tl.load(xw + c), 0), tl.zeros(words.shape, tl.int32))
            dots = _dot4(high, tl.expand_dims(tl.load(xw + 4 + c), 0), dots)
        part = tl.sum(dots, 2).to(tl.float32) * d * tl.expand_dims(tl.load(xd_row + b), 0)
        if FMT == Q4_1:
            part += mn * tl.expand_dims(tl.load(xs_row + b), 0)
    else:
        part = d * _float_dots(low, high, x_row, b, FMT)
        if FMT == Q4_1:
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
    base = tl.expand_dims(rows, 1) + tl.expand_dims((c // 4) * (144 if FMT == Q4_K else 176), 0)       # superblocks [BN, NB]
    quants = (base + (16 if FMT == Q4_K else 48) + 32 * tl.expand_dims(c % 4, 0)).to(tl.pointer_type(tl.int32))
    words = tl.load(quants[:, :, None] + tl.arange(0, 8)[None, None, :], mask=ok[:, :, None], other=0)
    head = base.to(tl.pointer_type(tl.int32))
    high = words
    if FMT == Q5_K:
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
        scale, low = scale_min((s0 >> shift) & 255, (s1 >> shift) & 255, (s2 >> shift) & 255, sub)
        xw, sums, xd = _q8_words(xq_row, xd_row, 2 * c + h)
        q = (words >> (4 * h)) & 0x0F0F0F0F
        if FMT == Q5_K:
            q |= ((high >> tl.expand_dims(sub, 2)) & 0x01010101) << 4
        dots = tl.sum(_dot4(q, tl.expand_dims(xw, 0), tl.zeros(words.shape, tl.int32)), 2)
        block_sums = tl.expand_dims(tl.sum(sums, 1).to(tl.float32) * xd, 0)
        total += d * scale * (dots.to(tl.float32) * tl.expand_dims(xd, 0)) - dmin * low * block_sums
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
    words = (start + superblocks * 128 + tl.expand_dims(c * 32, 0)).to(tl.pointer_type(tl.int32))
    high = words[:, :, None] + tl.arange(0, 8)[None, None, :]
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
    words_per_block: tl.constexpr = 8 if FMT == Q8_0 else 4
    at = tl.expand_dims(b, 1) * 32 + 4 * tl.arange(0, words_per_block)                             # [NB, words]
    total = tl.zeros(low.shape, tl.float32)
    for t in tl.static_range(4):
        total += _byte(low, t).to(tl.float32) * tl.expand_dims(tl.load(x_ptr + at + t), 0).to(tl.float32)
        if FMT != 8:
            total += _byte(high, t).to(tl.float32) * tl.expand_dims(tl.load(x_ptr + at + 16 + t), 0).to(tl.float32)
    return tl.sum(total, 2)


def quantized_matmul(x: torch.Tensor, w: DeviceQTensor, q8: bool, residual=None, norm=None, gate=NO_GATE) -> torch.Tensor:
    fmt = w.dtype.ggml_id
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = rows.shape
    N, blocks = w.shape[0], K // 32
    use_q8 = q8 and fmt in Q8_FORMATS
    if use_q8:                                              # the norm folds into the quantization
        xq = torch.empty((M, K), dtype=torch.int8, device=x.device)
        xd, xs = (torch.empty((M, blocks), dtype=torch.float32, device=x.device) for _ in range(2))
        whole = norm is not None and K <= ROW_READ               # the norm's row held by one program
        bpp = triton.next_power_of_2(blocks) if whole else 1
        _quantize_q8_kernel[(M, triton.cdiv(blocks, bpp))](rows, rows if norm is None else norm[0], xq, xd, xs, blocks,
                                                           0.0 if norm is None else float(norm[1]), NORM=norm is not None,
                                                           ROW=ROW_READ if norm is not None and not whole else 1, BPP=bpp,
                                                           WHOLE=whole, num_warps=max(4, min(16, bpp // 8)))   # 2 spill at 512
    else:
        rows = normalized(rows, norm)
        xq = xd = xs = rows
    if M <= GEMV_ROWS:
        # swept on an H200 (1B and 8B shapes, L2 cold, graphed and chained): 32-blocks, 32 blocks a step, two
        # rows per two-warp program at 4096 columns, four per one-warp program at fewer, one row of 64 blocks
        # a step for long rows; K-quants under q8,
        # 16 chunks a step, four rows per program, one warp for q4_K (q5_K untimed, alike), four for q6_K (long
        # rows: one row, one warp, 32 / 16 chunks); in f32, wider programs, and narrow layers more, smaller
        # programs; a gated product's program takes at least one (gate, up) pair
        if fmt in INT8_FORMATS:
            BN, NB, warps = (1, 64, 1) if K >= 8192 else ((2, 32, 2) if K >= 4096 else (4, 32, 1))
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

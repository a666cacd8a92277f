"""Integer dot products of 32-element weight blocks with q8-quantized activations, as llama.cpp does.

Activations are quantized once per call to q8_0 (q4_0, q5_0, q8_0 weights) or q8_1 (q4_1, q5_1,
which also need each block's sum): d = amax/127, q = round-half-even(x * 127/amax), the rounding
of ggml's x86 kernels. Each weight block then costs an int32 dot product and one scale multiply,
so results agree with llama.cpp's to float rounding, and token choices with its greedy decoding.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from soma_runtime.quant.formats import F16_TABLE, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

FORMATS = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
WITH_MIN = (Q4_1, Q5_1)             # these take q8_1 activations (block sums)
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34}


@njit(inline="always")
def _f16_round(v):
    """The f16 nearest to v (ties to even), as f32: rint at f16's 11-bit precision for v's exponent."""
    if v == 0:
        return np.float32(0)
    _, e = math.frexp(v)
    ulp = math.ldexp(1.0, max(e - 11, -24))          # f16 keeps 11 significant bits; subnormals step 2^-24
    return np.float32(np.rint(np.float64(v) / ulp) * ulp)


@njit(cache=True)
def _quantize_rows(x, qs, d, s):
    """x [M, K] f32 -> qs [M, K] int8, d and s (= d * sum q) [M, K/32] f32, f16-rounded like the file format."""
    for m in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            amax = np.float32(0)
            for j in range(32):
                amax = max(amax, abs(x[m, b * 32 + j]))
            inv = np.float32(127) / amax if amax != 0 else np.float32(0)
            total = 0
            for j in range(32):
                q = np.int32(np.rint(x[m, b * 32 + j] * inv))
                qs[m, b * 32 + j] = q
                total += q
            scale = amax / np.float32(127)
            d[m, b] = _f16_round(scale)
            s[m, b] = _f16_round(scale * np.float32(total))


@njit(inline="always")
def _block_dot(fmt, w, o, qs, e):
    """int32 dot of one weight block (bytes at w[o:]) with 32 activation quants at qs[e:]."""
    acc = np.int32(0)
    if fmt == Q8_0:
        for j in range(32):
            acc += np.int32(np.int8(w[o + 2 + j])) * np.int32(qs[e + j])
        return acc
    if fmt == Q4_0 or fmt == Q4_1:
        base = o + (2 if fmt == Q4_0 else 4)
        bias = 8 if fmt == Q4_0 else 0
        for j in range(16):
            b = np.int32(w[base + j])
            acc += ((b & 15) - bias) * np.int32(qs[e + j]) + ((b >> 4) - bias) * np.int32(qs[e + j + 16])
        return acc
    hq = o + (2 if fmt == Q5_0 else 4)
    qh = np.uint32(w[hq]) | (np.uint32(w[hq + 1]) << 8) | (np.uint32(w[hq + 2]) << 16) | (np.uint32(w[hq + 3]) << 24)
    bias = 16 if fmt == Q5_0 else 0
    for j in range(16):
        b = np.int32(w[hq + 4 + j])
        lo = (b & 15) | np.int32(((qh >> j) & 1) << 4)
        hi = (b >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
        acc += (lo - bias) * np.int32(qs[e + j]) + (hi - bias) * np.int32(qs[e + j + 16])
    return acc


def _make_gemv(fmt: int):
    """A q8-activation matmul specialized for one weight format (the format is a compile-time constant,
    so the block decoder has no branches); activations are quantized inside the same parallel launch."""
    size = BLOCK_BYTES[fmt]
    with_min = fmt in WITH_MIN

    @njit(parallel=True, cache=True)
    def gemv(w, x, out, lut):
        m_rows, n_blocks = x.shape[0], x.shape[1] // 32
        qs = np.empty(x.shape, np.int8)
        d = np.empty((m_rows, n_blocks), np.float32)
        s = np.empty((m_rows, n_blocks), np.float32)
        _quantize_rows(x, qs, d, s)
        for n in prange(w.shape[0]):
            row = w[n]
            for m in range(m_rows):
                xq, dm = qs[m], d[m]
                acc = np.float32(0)
                mins = np.float32(0)
                for b in range(n_blocks):
                    o = b * size
                    dw = lut[np.int32(row[o]) | (np.int32(row[o + 1]) << 8)]
                    acc += (dw * dm[b]) * np.float32(_block_dot(fmt, row, o, xq, b * 32))
                    if with_min:
                        mins += lut[np.int32(row[o + 2]) | (np.int32(row[o + 3]) << 8)] * s[m, b]
                out[m, n] = acc + mins
    return gemv


GEMV = {fmt: _make_gemv(fmt) for fmt in FORMATS}


def quantize_activations(x: np.ndarray):
    m, k = x.shape
    qs = np.empty((m, k), np.int8)
    d = np.empty((m, k // 32), np.float32)
    s = np.empty((m, k // 32), np.float32)
    _quantize_rows(np.ascontiguousarray(x, dtype=np.float32), qs, d, s)
    return qs, d, s


def matmul_q8(x: np.ndarray, data: np.ndarray, fmt: int) -> np.ndarray:
    """x [M, K] f32 times packed weights [N, row_bytes] of a 32-block format -> [M, N] f32."""
    out = np.empty((x.shape[0], data.shape[0]), np.float32)
    GEMV[fmt](data, np.ascontiguousarray(x, dtype=np.float32), out, F16_TABLE)
    return out


def q8_rounded(x: np.ndarray) -> np.ndarray:
    """The activations as llama.cpp's q8 blocks represent them (q * d), for a BLAS product: equal to the
    integer-dot result up to f32 summation order (and, for q4_1/q5_1, the f16 rounding of block sums)."""
    qs, d, _ = quantize_activations(x)
    return (qs.reshape(*d.shape, 32).astype(np.float32) * d[..., None]).reshape(x.shape)

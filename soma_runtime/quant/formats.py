"""Row decoders for every stored weight format (GGUF block layouts, see dtypes.py), in numba.

One decoder per format turns one row of packed blocks into f32. They are the single source of
truth for block decoding: full dequantize, embedding rows and the CPU matmul jets all call
`dequant_row`. Arithmetic is f32 in the same order as ggml's reference, so results are exact.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16, TQ1_0, TQ2_0 = 10, 11, 12, 13, 14, 30, 34, 35
SUPPORTED = (F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16, TQ1_0, TQ2_0)

# f16 bit pattern -> f32 value; numba has no half type, a 256 KiB table is exact and fast.
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(inline="always")
def _f16(src, o, lut):
    return lut[np.int64(src[o]) | (np.int64(src[o + 1]) << 8)]


@njit(inline="always")
def _u32(src, o):
    return np.uint32(src[o]) | (np.uint32(src[o + 1]) << 8) | (np.uint32(src[o + 2]) << 16) | (np.uint32(src[o + 3]) << 24)


@njit(cache=True)
def _row_q4_0(src, out, lut):
    for b in range(out.size // 32):
        o, e = b * 18, b * 32
        d = _f16(src, o, lut)
        for j in range(16):
            q = src[o + 2 + j]
            out[e + j] = d * np.float32(np.int32(q & 15) - 8)
            out[e + j + 16] = d * np.float32(np.int32(q >> 4) - 8)


@njit(cache=True)
def _row_q4_1(src, out, lut):
    for b in range(out.size // 32):
        o, e = b * 20, b * 32
        d, m = _f16(src, o, lut), _f16(src, o + 2, lut)
        for j in range(16):
            q = src[o + 4 + j]
            out[e + j] = d * np.float32(q & 15) + m
            out[e + j + 16] = d * np.float32(q >> 4) + m


@njit(cache=True)
def _row_q5(src, out, lut, with_min):
    size = 24 if with_min else 22
    for b in range(out.size // 32):
        o, e = b * size, b * 32
        d = _f16(src, o, lut)
        m = _f16(src, o + 2, lut) if with_min else np.float32(0)
        qo = o + 4 if with_min else o + 2
        qh = _u32(src, qo)
        for j in range(16):
            q = src[qo + 4 + j]
            lo = np.int32(q & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = np.int32(q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            if with_min:
                out[e + j] = d * np.float32(lo) + m
                out[e + j + 16] = d * np.float32(hi) + m
            else:
                out[e + j] = d * np.float32(lo - 16)
                out[e + j + 16] = d * np.float32(hi - 16)


@njit(cache=True)
def _row_q8_0(src, out, lut):
    for b in range(out.size // 32):
        o, e = b * 34, b * 32
        d = _f16(src, o, lut)
        for j in range(32):
            out[e + j] = np.float32(np.int8(src[o + 2 + j])) * d


@njit(cache=True)
def _row_q2_K(src, out, lut):
    for b in range(out.size // 256):
        o, e = b * 84, b * 256
        d, dmin = _f16(src, o + 80, lut), _f16(src, o + 82, lut)
        for i in range(256):
            g, s, l = i // 128, (i % 128) // 32, i % 32
            q = (src[o + 16 + g * 32 + l] >> (2 * s)) & 3
            sc = src[o + i // 16]
            dl = d * np.float32(sc & 15)
            ml = dmin * np.float32(sc >> 4)
            out[e + i] = dl * np.float32(q) - ml


@njit(cache=True)
def _row_q3_K(src, out, lut):
    scales = np.empty(16, np.float32)
    for b in range(out.size // 256):
        o, e = b * 110, b * 256
        d = _f16(src, o + 108, lut)
        for i in range(16):
            lo = (src[o + 96 + i % 8] >> (4 * (i // 8))) & 15
            hi = (src[o + 104 + i % 4] >> (2 * (i // 4))) & 3
            scales[i] = d * np.float32(np.int32(lo | (hi << 4)) - 32)
        for i in range(256):
            g, s, l = i // 128, (i % 128) // 32, i % 32
            ql = np.int32((src[o + 32 + g * 32 + l] >> (2 * s)) & 3)
            h = np.int32((src[o + i % 32] >> (i // 32)) & 1)
            out[e + i] = scales[i // 16] * np.float32(ql - ((h ^ 1) << 2))


@njit(inline="always")
def _k_scale_min(src, so, j):
    """The j-th 6-bit (scale, min) pair of a q4_K/q5_K block's 12 packed scale bytes at so."""
    if j < 4:
        return src[so + j] & 63, src[so + 4 + j] & 63
    md = src[so + 4 + j]
    return (md & 15) | ((src[so + j - 4] >> 2) & 0x30), (md >> 4) | ((src[so + j] >> 2) & 0x30)


@njit(cache=True)
def _row_q45_K(src, out, lut, five_bit):
    size = 176 if five_bit else 144
    qs = 48 if five_bit else 16
    for b in range(out.size // 256):
        o, e = b * size, b * 256
        d, dmin = _f16(src, o, lut), _f16(src, o + 2, lut)
        for j in range(8):
            sc, mn = _k_scale_min(src, o + 4, j)
            dd = d * np.float32(sc)
            dm = dmin * np.float32(mn)
            g, s = j // 2, j % 2
            for l in range(32):
                q = (src[o + qs + g * 32 + l] >> (4 * s)) & 15
                if five_bit:
                    q |= ((src[o + 16 + l] >> j) & 1) << 4
                out[e + j * 32 + l] = dd * np.float32(q) - dm


@njit(cache=True)
def _row_q6_K(src, out, lut):
    for b in range(out.size // 256):
        o, e = b * 210, b * 256
        d = _f16(src, o + 208, lut)
        for i in range(256):
            g, r = i // 128, i % 128
            ql = (src[o + g * 64 + r % 64] >> (4 * (r // 64))) & 15
            qh = (src[o + 128 + g * 32 + r % 32] >> (2 * (r // 32))) & 3
            ds = d * np.float32(np.int8(src[o + 192 + i // 16]))
            out[e + i] = ds * np.float32(np.int32(ql | (qh << 4)) - 32)


@njit(cache=True)
def _row_tq1_0(src, out, lut):
    for b in range(out.size // 256):
        o, e = b * 54, b * 256
        d = _f16(src, o + 52, lut)
        for i in range(256):
            if i < 160:
                byte, p = src[o + i % 32], i // 32
            elif i < 240:
                byte, p = src[o + 32 + (i - 160) % 16], (i - 160) // 16
            else:
                byte, p = src[o + 48 + (i - 240) % 4], (i - 240) // 4
            t = np.uint8(np.uint32(byte) * np.uint32(3 ** p))   # wraps like the uint8 reference
            out[e + i] = d * np.float32(np.int32((np.uint32(t) * 3) >> 8) - 1)


@njit(cache=True)
def _row_tq2_0(src, out, lut):
    for b in range(out.size // 256):
        o, e = b * 66, b * 256
        d = _f16(src, o + 64, lut)
        for i in range(256):
            g, s, l = i // 128, (i % 128) // 32, i % 32
            out[e + i] = d * np.float32(np.int32((src[o + g * 32 + l] >> (2 * s)) & 3) - 1)


@njit(cache=True)
def _row_plain(src, out, lut, fmt):
    if fmt == F16:
        for i in range(out.size):
            out[i] = _f16(src, 2 * i, lut)
        return
    bits = out.view(np.uint32)
    for i in range(out.size):
        if fmt == BF16:
            bits[i] = (np.uint32(src[2 * i]) << 16) | (np.uint32(src[2 * i + 1]) << 24)
        else:
            bits[i] = _u32(src, 4 * i)


@njit(cache=True)
def dequant_row(fmt, src, out, lut):
    """Decode one row of `fmt` (GGML type id) from bytes `src` into f32 `out`."""
    if fmt == Q4_0:
        _row_q4_0(src, out, lut)
    elif fmt == Q4_1:
        _row_q4_1(src, out, lut)
    elif fmt == Q5_0:
        _row_q5(src, out, lut, False)
    elif fmt == Q5_1:
        _row_q5(src, out, lut, True)
    elif fmt == Q8_0:
        _row_q8_0(src, out, lut)
    elif fmt == Q2_K:
        _row_q2_K(src, out, lut)
    elif fmt == Q3_K:
        _row_q3_K(src, out, lut)
    elif fmt == Q4_K:
        _row_q45_K(src, out, lut, False)
    elif fmt == Q5_K:
        _row_q45_K(src, out, lut, True)
    elif fmt == Q6_K:
        _row_q6_K(src, out, lut)
    elif fmt == TQ1_0:
        _row_tq1_0(src, out, lut)
    elif fmt == TQ2_0:
        _row_tq2_0(src, out, lut)
    else:
        _row_plain(src, out, lut, fmt)


@njit(parallel=True, cache=True)
def _dequant_rows(data, fmt, out, lut):
    for r in prange(data.shape[0]):
        dequant_row(fmt, data[r], out[r], lut)


@njit(cache=True)
def dequant_rows_serial(data, fmt, out, lut):
    """Decode on the calling thread, e.g. between BLAS calls whose worker threads still spin."""
    for r in range(data.shape[0]):
        dequant_row(fmt, data[r], out[r], lut)


def dequantize_rows(data: np.ndarray, fmt: int, n: int) -> np.ndarray:
    """Decode a [rows, row_bytes] byte matrix of format `fmt` into f32 [rows, n]."""
    if fmt not in SUPPORTED:
        raise ValueError(f"no decoder for GGML type {fmt}")
    data = np.ascontiguousarray(data.reshape(-1, data.shape[-1]))
    out = np.empty((data.shape[0], n), np.float32)
    _dequant_rows(data, fmt, out, F16_TABLE)
    return out

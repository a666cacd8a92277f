"""Matmuls of 32-weight blocks with q8-quantized activations, as llama.cpp computes them.

Activations are quantized once per call to q8 blocks: d = amax/127, q = round-half-even(x * 127/amax),
the rounding of ggml's x86 kernels, plus s = d * sum q for formats with a min (q4_1, q5_1). Each
weight block then costs an exact integer dot (simd.py) and one scale multiply-add into 8 float lanes,
summed in ggml's order, so results agree with llama.cpp's to float rounding.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from soma_runtime.backends.cpu import simd
from soma_runtime.backends.cpu.elementwise import rmsnorm_rows
from soma_runtime.quant.formats import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

FORMATS = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
TILE_ROWS = 16          # weight rows per parallel task


@njit(inline="always")
def _f16_round(v):
    """The f16 nearest to v (ties to even), as f32: rint at f16's 11-bit precision for v's exponent."""
    if v == 0:
        return np.float32(0)
    _, e = math.frexp(v)
    ulp = math.ldexp(1.0, max(e - 11, -24))          # f16 keeps 11 significant bits; subnormals step 2^-24
    return np.float32(np.rint(np.float64(v) / ulp) * ulp)


@njit(cache=True, error_model="numpy")
def _quantize_rows(x, qs, d, s, groups):
    """x [M, K] f32 -> qs [M, K] int8, d [M, K/32] and s = d * sum q [K/32, M] f32 (transposed: the
    kernels read one block's sums for several rows at once), f16-rounded like the file format; and
    the exact sums of each 4 consecutive q, added into groups [M, K/4] int32 (given zeroed: what a weight bias multiplies)."""
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
                groups[m, b * 8 + j // 4] += q
            scale = amax / np.float32(127)
            d[m, b] = _f16_round(scale)
            s[b, m] = _f16_round(scale * np.float32(total))


@njit(cache=True)
def quantize(x):
    """The q8 blocks of x [M, K]: (qs, d, s, groups) as `_quantize_rows` describes."""
    m, k = x.shape
    qs = np.empty((m, k), np.int8)
    d, s = np.empty((m, k // 32), np.float32), np.empty((k // 32, m), np.float32)
    groups = np.zeros((m, k // 4), np.int32)
    _quantize_rows(x, qs, d, s, groups)
    return qs, d, s, groups


@njit(inline="always")
def dot_tile(fmt, path, w, qs, d, s, groups, m_lo, m_hi, lo, hi, out):
    """out[m, n] for activation rows m_lo..m_hi-1 and weight rows lo..hi-1 of `w`: each weight block
    decoded once per 8 (or 4) activation rows. `fmt` and `path` (1: no VNNI) are compile-time constants."""
    m = m_lo
    while m + 8 <= m_hi:
        for n in range(lo, hi):
            simd.row_dots(fmt, 8, path, w, qs, d, s, groups, m, n, out)
        m += 8
    while m + 4 <= m_hi:
        for n in range(lo, hi):
            simd.row_dots(fmt, 4, path, w, qs, d, s, groups, m, n, out)
        m += 4
    while m < m_hi:
        for n in range(lo, hi):
            simd.row_dots(fmt, 1, path, w, qs, d, s, groups, m, n, out)
        m += 1


def make_matmul(fmt: int, portable: bool = False):
    """x [M, K] f32 @ weight rows [N, row bytes] of `fmt` -> out [M, N]: activations quantized once,
    then tiles of weight rows in parallel. `portable` skips VNNI (to test that path where the CPU has it).
    The closure holds integers only: numba's disk cache keys a kernel on its closure's pickle, which a
    function in it would change in every process (a recompile at every start)."""
    path, stamp = int(portable), simd.SOURCE_STAMP

    @njit(parallel=True, cache=True)
    def matmul(w, x, out, tile_rows, norm, eps, residual):
        """With a `norm` weight (size 0: none), x is rmsnorm'd first; with a `residual` [M, N] (size 0:
        none), it is added to out: the same f32 roundings as the separate ops, without their calls."""
        assert stamp == simd.SOURCE_STAMP        # in the closure, so the disk cache keys on simd.py too
        if norm.size:
            normed = np.empty_like(x)
            rmsnorm_rows(x, norm, eps, normed)
            x = normed
        qs, d, s, groups = quantize(x)
        m_rows, n_rows = x.shape[0], w.shape[0]
        for tile in prange((n_rows + tile_rows - 1) // tile_rows):
            lo, hi = tile * tile_rows, min(n_rows, (tile + 1) * tile_rows)
            dot_tile(fmt, path, w, qs, d, s, groups, 0, m_rows, lo, hi, out)
            if residual.size:
                for m in range(m_rows):
                    for n in range(lo, hi):
                        out[m, n] += residual[m, n]
    return matmul


def make_grouped_matmul(fmt: int):
    """Rows grouped by expert times each group's expert: out[m] = x[m] @ expert(e).T for the rows m in
    bounds[i]..bounds[i+1]-1 of expert e = experts[i], experts stacked as w [E * N, row bytes]; one
    parallel pass over every (expert, tile of its weight rows), the activations quantized once."""
    stamp = simd.SOURCE_STAMP

    @njit(parallel=True, cache=True)
    def grouped(w, n_rows, x, bounds, experts, out, tile_rows):
        assert stamp == simd.SOURCE_STAMP
        qs, d, s, groups = quantize(x)
        tiles = (n_rows + tile_rows - 1) // tile_rows
        for task in prange(experts.size * tiles):
            i, t = task // tiles, task % tiles
            e = experts[i]
            dot_tile(fmt, 0, w[e * n_rows:(e + 1) * n_rows], qs, d, s, groups, bounds[i], bounds[i + 1], t * tile_rows,
                    min(n_rows, (t + 1) * tile_rows), out)
    return grouped


MATMUL = {fmt: make_matmul(fmt) for fmt in FORMATS}
GROUPED = {fmt: make_grouped_matmul(fmt) for fmt in FORMATS}


NONE_1D, NONE_2D = np.empty(0, np.float32), np.empty((0, 0), np.float32)


def matmul_q8(x: np.ndarray, data: np.ndarray, fmt: int, norm=None, eps: float = 0.0, residual=None, out=None) -> np.ndarray:
    """x [M, K] f32 times packed weights [N, row_bytes] of a 32-block format -> [M, N] f32 (into
    `out` if given); x rmsnorm'd by `norm` (f32 [K]) first and `residual` (f32 [M, N]) added, where given."""
    out = np.empty((x.shape[0], data.shape[0]), np.float32) if out is None else out
    MATMUL[fmt](data, np.ascontiguousarray(x, dtype=np.float32), out, TILE_ROWS, NONE_1D if norm is None else norm,
                np.float32(eps), NONE_2D if residual is None else residual)
    return out


def grouped_matmul_q8(x: np.ndarray, data: np.ndarray, fmt: int, n: int, bounds: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """x [M, K] f32, its rows grouped by expert (bounds, experts: see make_grouped_matmul), times the
    experts' packed weights [E * n, row_bytes] -> [M, n] f32."""
    out = np.empty((x.shape[0], n), np.float32)
    GROUPED[fmt](data, n, np.ascontiguousarray(x, dtype=np.float32), bounds, experts, out, TILE_ROWS)
    return out


def q8_rounded(x: np.ndarray) -> np.ndarray:
    """The activations as their q8 blocks represent them (q * d), for a BLAS product: equal to the
    integer-dot result up to f32 summation order (and, for q4_1/q5_1, the f16 rounding of block sums)."""
    qs, d, _, _ = quantize(np.ascontiguousarray(x, dtype=np.float32))
    return (qs.reshape(*d.shape, 32).astype(np.float32) * d[..., None]).reshape(x.shape)

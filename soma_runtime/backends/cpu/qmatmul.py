"""Matmul with a stored-format weight (GGUF blocks, f16, bf16) read in place, never expanded whole.

With q8 `activations`, the 32-block formats (q4_0, q4_1, q5_0, q5_1, q8_0) use llama.cpp's scheme:
q8 activations and integer block dots (qdot.py); for many rows the autotune table may pick the
q8-rounded activations through the BLAS path below instead, or (where the CPU has AMX, any block
format) weight tiles decoded to bf16 on the matrix units. Otherwise weight rows decode to f32:

GEMV (decode, few rows): one numba pass, parallel over output rows; each weight row is decoded
into a small f32 buffer and dotted with every activation row. GEMM (prefill, many rows): a tile
of weight rows is decoded once (on the calling thread: BLAS's workers are still spinning on the
other cores) and multiplied by all rows with BLAS.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from soma_runtime.backends.cpu import amx, autotune, blas, qdot, simd
from soma_runtime.backends.cpu.common import deliver
from soma_runtime.dtypes import QTensor, dtype
from soma_runtime.quant.formats import BF16, F16, F16_TABLE, dequant_row, dequant_rows_serial

GEMV_MAX_ROWS = 8      # up to this many activation rows, the fused decode-and-dot pass wins
BLAS_MIN_ROWS = 64     # below this, decoding whole weights per call for BLAS never pays (batched decode)
TILE_BYTES = 1 << 21   # f32 bytes of weight rows decoded per GEMM tile (fits L2)
ROWS_PER_TASK = 16


@njit(parallel=True, cache=True)
def _gemv(w, fmt, x, out, lut):
    n_rows, k = w.shape[0], x.shape[1]
    for task in prange((n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        row = np.empty(k, np.float32)
        for n in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            dequant_row(fmt, w[n], row, lut)
            for m in range(x.shape[0]):
                out[m, n] = _dot(x[m], row)


def _make_half_gemv(bf16: bool):
    """Few activation rows times f16/bf16 weight rows ([N, K] as uint16 bits), converted in registers."""
    kind, stamp = int(bf16), simd.SOURCE_STAMP

    @njit(parallel=True, fastmath={"reassoc", "nsz", "contract"}, cache=True)
    def gemv(w, x, out):
        assert stamp == simd.SOURCE_STAMP        # in the closure, so the disk cache keys on simd.py too
        for n in prange(w.shape[0]):
            row = w[n]
            for m in range(x.shape[0]):
                acc = np.float32(0)
                for i in range(row.size):
                    acc += simd.widen_bits(row[i], kind) * x[m, i]
                out[m, n] = acc
            for i in range(0, row.size, 32):      # the lines 4 rows on: the stream from memory runs ~1.4x faster
                simd.prefetch_element(row, i, 8 * row.size)
    return gemv


HALF_GEMV = {"f16": _make_half_gemv(False), "bf16": _make_half_gemv(True)}
HALF_NUMPY = {F16: np.dtype(np.float16), BF16: dtype("bf16").numpy}


@njit(fastmath={"reassoc", "nsz", "contract"}, cache=True)
def _dot(a, b):
    # reassociation lets LLVM vectorize the sum; the error stays within f32 matmul tolerance
    acc = np.float32(0)
    for i in range(a.size):
        acc += a[i] * b[i]
    return acc


def weight_bytes(w) -> tuple[np.ndarray, int]:
    """The [N, row_bytes] byte view and GGML type id of a stored-format weight."""
    if isinstance(w, QTensor):
        return w.data, w.dtype.ggml_id
    w = np.ascontiguousarray(w)
    name = "bf16" if w.dtype.name == "bfloat16" else "f16"
    return w.view(np.uint8).reshape(w.shape[0], -1), dtype(name).ggml_id


def matmul_stored(x: np.ndarray, w, out: np.ndarray | None = None, activations: str = "f32") -> np.ndarray:
    """x[..., K] (f32) times the transpose of a stored-format weight [N, K] -> [..., N] f32, the
    activations rounded as `activations` (f32, bf16, q8) allows."""
    data, fmt = weight_bytes(w)
    n, k = w.shape
    rows = np.ascontiguousarray(x.reshape(-1, k), dtype=np.float32)
    few = rows.shape[0] <= GEMV_MAX_ROWS
    tuned = autotune.choice(prefill_key(w)) if activations == "q8" and rows.shape[0] >= BLAS_MIN_ROWS else None
    if tuned == "amx" and amx.available():      # bf16 tiles on the matrix units (amx.py)
        return deliver(amx.quantized_matmul(rows, data, fmt, n).reshape(*x.shape[:-1], n), "f32", out)
    if activations == "q8" and fmt in qdot.FORMATS:
        if tuned != "blas":
            return deliver(qdot.matmul_q8(rows, data, fmt).reshape(*x.shape[:-1], n), "f32", out)
        rows = qdot.q8_rounded(rows)          # the tuned choice here: llama.cpp's rounding at BLAS speed
    half = None if isinstance(w, QTensor) else {F16: "f16", BF16: "bf16"}.get(fmt)
    if few and half:
        result = np.empty((rows.shape[0], n), np.float32)
        HALF_GEMV[half](data.view(np.uint16), rows, result)
    elif few:
        result = np.empty((rows.shape[0], n), np.float32)
        _gemv(data, fmt, rows, result, F16_TABLE)
    else:
        result = gemm_tiled(rows, data, fmt, n)
    return deliver(result.reshape(*x.shape[:-1], n), "f32", out)


def gemm_tiled(rows: np.ndarray, data: np.ndarray, fmt: int, n: int) -> np.ndarray:
    """Decode a tile of weight rows, multiply it by every activation row with BLAS, next tile."""
    k = rows.shape[1]
    result_t = np.empty((n, rows.shape[0]), np.float32)      # each tile's product lands contiguously
    tile_rows = max(ROWS_PER_TASK, TILE_BYTES // (4 * k))
    tile = np.empty((min(tile_rows, n), k), np.float32)
    for start in range(0, n, tile_rows):
        stop = min(n, start + tile_rows)
        if fmt in HALF_NUMPY:                 # numpy's SIMD casts beat a per-element decode
            tile[: stop - start] = data[start:stop].view(HALF_NUMPY[fmt])
        else:
            dequant_rows_serial(data[start:stop], fmt, tile[: stop - start], F16_TABLE)
        blas.matmul(tile[: stop - start], rows.T, result_t[start:stop])
    return result_t.T


def variant_names(w) -> tuple[str, ...]:
    """The prefill kernels a stored-format weight can run on this machine (see prefill_variants)."""
    if not isinstance(w, QTensor) or len(w.shape) != 2:
        return ()
    names = ("int8", "blas") if w.dtype.ggml_id in qdot.FORMATS else ("blas",)
    return names + (("amx",) if amx.fits(*w.shape) and amx.available() else ())


def prefill_key(w) -> str | None:
    """The autotune key of a many-row q8-activation matmul with this weight (None: nothing to
    choose). It names the variants, so a machine that gains one tunes again."""
    names = variant_names(w)
    if len(names) < 2:
        return None
    return f"matmul_q8/{w.dtype.name}/{w.shape[0]}x{w.shape[1]}/prefill/{','.join(names)}"


PREFILL_ROWS = 128           # the activation rows a prefill variant is timed with


def tune(weights, force: bool = False) -> dict[str, dict]:
    """Time the prefill variants for every distinct weight shape in `weights` that the dispatch table
    does not cover yet (all of them when `force`); record the winners. Returns {key: {"choice": name,
    "seconds": {variant: best time}}} for what was measured."""
    measured = {}
    for w in weights:
        key = prefill_key(w)
        if key is None or key in measured or (not force and autotune.choice(key) is not None):
            continue
        best, times = autotune.fastest(prefill_variants(w, PREFILL_ROWS))
        measured[key] = {"choice": best, "seconds": times}
    if measured:
        autotune.record({k: v["choice"] for k, v in measured.items()})
    return measured


def prefill_variants(w: QTensor, rows: int) -> dict:
    """The kernels a prefill matmul with `w` can run, as calls on random activations: integer block
    dots (32-block formats), dequantized tiles through BLAS (the activations q8-rounded for those
    formats), or bf16 tiles on the matrix units (where the CPU has them)."""
    x = np.random.default_rng(0).standard_normal((rows, w.shape[1])).astype(np.float32)
    fmt, n = w.dtype.ggml_id, w.shape[0]
    calls = {"int8": lambda: qdot.matmul_q8(x, w.data, fmt),
             "blas": lambda: gemm_tiled(qdot.q8_rounded(x) if fmt in qdot.FORMATS else x, w.data, fmt, n),
             "amx": lambda: amx.quantized_matmul(x, w.data, fmt, n)}
    return {name: calls[name] for name in variant_names(w)}

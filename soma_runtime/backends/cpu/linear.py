"""CPU jets for matmul (BLAS for f32; stored-format weights through qmatmul; bf16 weights under
bf16 or q8 activations on AMX), rope, embedding and the paged KV cache."""
from __future__ import annotations

import types

import numpy as np
from numba import njit, prange

from soma_runtime.backends.cpu import amx, blas, qdot
from soma_runtime.backends.cpu.common import CPU, HALF, INT, ROPE_INPUTS, F, all_f32, deliver, dense, f32, float_kernel, out_f32
from soma_runtime.backends.cpu.elementwise import geglu, gelu_in_place, rmsnorm, swiglu
from soma_runtime.backends.cpu.qmatmul import GEMV_MAX_ROWS, matmul_stored
from soma_runtime.backends.cpu.simd import stored
from soma_runtime.dtypes import QUANTIZED, QTensor, dtype_of
from soma_runtime.ir.jets import jet
from soma_runtime.ir.ops import GATED
from soma_runtime.quant import dequantize, kv

SMALL_ROWS = 32      # up to this many rows, BLAS's packing of the weight costs more than the product
SERIAL_WEIGHT = 1 << 17   # a weight under this many elements is read by one thread (waking others costs more)


def few_rows_matmul(a, w, out):
    """a [M, K] @ w[N, K].T for small M: each weight row is read once and dotted with 4 rows at a time."""
    rows = a.shape[0]
    for n in prange(w.shape[0]):
        wr = w[n]
        m = 0
        while m + 4 <= rows:
            a0, a1, a2, a3 = a[m], a[m + 1], a[m + 2], a[m + 3]
            s0 = s1 = s2 = s3 = np.float32(0)
            for k in range(wr.size):
                s0 += a0[k] * wr[k]
                s1 += a1[k] * wr[k]
                s2 += a2[k] * wr[k]
                s3 += a3[k] * wr[k]
            out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = s0, s1, s2, s3
            m += 4
        for r in range(m, rows):
            s = np.float32(0)
            for k in range(wr.size):
                s += a[r, k] * wr[k]
            out[r, n] = s


def named(fn, name: str):
    """fn as a function of another name: numba caches what it compiles under the function's name."""
    clone = types.FunctionType(fn.__code__, fn.__globals__, name)
    clone.__qualname__ = name
    return clone


FASTMATH = {"reassoc", "contract", "nsz"}
_few_rows_matmul = njit(parallel=True, fastmath=FASTMATH, cache=True)(few_rows_matmul)
_few_rows_serial = njit(fastmath=FASTMATH, cache=True)(named(few_rows_matmul, "few_rows_serial"))   # the same sums


@jet("matmul", CPU, [(F, F, b, r, n) for b in ("none", F) for r in ("none", F) for n in ("none", F)]
     + [("f32", q, b, r, n) for q in QUANTIZED for b in ("none", "f32") for r in ("none", "f32") for n in ("none", "f32")])
def matmul(a, b, bias=None, residual=None, norm=None, out=None, transpose_b=False, activations="f32", epilogue="none",
           norm_eps=1e-6):
    if epilogue in GATED:                    # the product as it would run alone, then its column pairs gated
        y = matmul(a, b, bias, None, norm, transpose_b=transpose_b, activations=activations, norm_eps=norm_eps)
        gate, up = y[..., 0::2], y[..., 1::2]
        out = swiglu(gate, up, out=out) if epilogue == "swiglu" else geglu(gate, up, out=out, approximate="tanh")
        return out if residual is None else deliver(out + f32(residual), dtype_of(a), out)
    if decode_q8(a, b, bias, residual, norm, activations, epilogue):     # one call: norm, q8 dots, residual
        rows, result = a.reshape(-1, a.shape[-1]), out_f32(out, (*a.shape[:-1], b.shape[0]))
        shape = (rows.shape[0], b.shape[0])              # explicit: a step may want no rows
        qdot.matmul_q8(rows, b.data, b.dtype.ggml_id, norm, norm_eps, None if residual is None else residual.reshape(shape),
                       result.reshape(shape))
        return result
    if norm is not None:
        a = rmsnorm(a, norm, eps=norm_eps)
    # bf16 weights on the matrix units: every row count under bf16 activations (a row's numbers must
    # not depend on its batch); under q8 (GGUF), only past the rows where decode's GEMV wins
    if activations != "f32" and transpose_b and amx.takes(a, b, 0 if activations == "bf16" else GEMV_MAX_ROWS):
        result = amx.linear(a, b, bias, out, amx.EPILOGUES.index(epilogue))      # an f32 buffer of its own
        if residual is not None:
            result += f32(residual)
        return result
    result = product(a, b, out, transpose_b, activations)
    if bias is None and epilogue == "none" and residual is None:
        return result
    result = own_f32(result)
    if bias is not None:
        result += f32(bias)                   # in place: the product is this op's own buffer
    if epilogue != "none":
        gelu_in_place(result.reshape(-1), epilogue == "gelu_tanh")
    if residual is not None:
        result += f32(residual)
    return deliver(result, dtype_of(a), out)


def decode_q8(a, b, bias, residual, norm, activations, epilogue) -> bool:
    """Whether a matmul is decode's: a few f32 rows against 32-weight blocks under q8 activations,
    norm and residual (if any) f32 and contiguous, nothing else around it."""
    return (isinstance(b, QTensor) and b.dtype.ggml_id in qdot.FORMATS and activations == "q8" and bias is None
            and epilogue == "none" and a.size // a.shape[-1] <= GEMV_MAX_ROWS and all(
                t is None or (t.dtype == np.float32 and t.flags.c_contiguous) for t in (a, residual, norm)))


def own_f32(result: np.ndarray) -> np.ndarray:
    """The product as a writable contiguous f32 buffer (itself when it already is one)."""
    if all_f32(result) and result.flags.writeable and result.flags.c_contiguous:
        return result
    return np.array(f32(result), order="C")


def product(a, b, out, transpose_b, activations):
    like = dtype_of(a)
    stored = isinstance(b, QTensor) or (b.ndim == 2 and transpose_b and dtype_of(b) in HALF and like == "f32")
    if stored:
        return deliver(matmul_stored(f32(a), b, activations=activations), like, out)
    b = f32(b)
    if transpose_b and b.ndim == 2 and all_f32(a, b) and a.size // a.shape[-1] <= SMALL_ROWS:
        result = out_f32(out, (*a.shape[:-1], b.shape[0]))
        kernel = _few_rows_serial if b.size < SERIAL_WEIGHT else _few_rows_matmul
        kernel(dense(a).reshape(-1, a.shape[-1]), dense(b), result.reshape(-1, b.shape[0]))
        return result
    b = np.swapaxes(b, -1, -2) if transpose_b else b
    if b.ndim == 2 and a.ndim >= 2 and a.flags.c_contiguous:    # one product over all rows, not one per batch item
        rows = out_f32(out if like == "f32" else None, (*a.shape[:-1], b.shape[-1]))
        blas.matmul(f32(a).reshape(-1, a.shape[-1]), b, rows.reshape(-1, b.shape[-1]))
        return deliver(rows, like, out)
    if out is not None and like == "f32":
        return np.matmul(a, b, out=out)
    return deliver(np.matmul(f32(a), b), like, out)


@njit(cache=True, error_model="numpy")
def _rope(x, positions, inv_freq, neox, out):
    """x, out [S, H, D] f32; pairs (i, i + R/2) when neox, else (2i, 2i + 1); dims past R copy through."""
    half = inv_freq.shape[0]
    for s in range(x.shape[0]):
        for i in range(half):
            angle = np.float32(positions[s]) * inv_freq[i]
            c, sn = np.cos(angle), np.sin(angle)
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            for h in range(x.shape[1]):
                first, second = x[s, h, a], x[s, h, b]
                out[s, h, a] = first * c - second * sn
                out[s, h, b] = second * c + first * sn
        for h in range(x.shape[1]):
            for d in range(2 * half, x.shape[2]):
                out[s, h, d] = x[s, h, d]


@jet("rope", CPU, [(F, INT, "f32")])
def rope(x, positions, inv_freq, out=None, style="neox"):
    if all_f32(x) and x.ndim == 3 and positions.shape == x.shape[:1]:
        result = out_f32(out, x.shape)
        _rope(dense(x), dense(positions), dense(inv_freq), style == "neox", result)
        return result
    return _rope_numpy(x, positions, inv_freq, style=style, out=out)


@float_kernel
def _rope_numpy(x, positions, inv_freq, style):
    half = inv_freq.shape[0]
    angle = (positions[..., None].astype(np.float32) * inv_freq)[..., None, :]   # [..., S, 1, R/2]
    cos, sin = np.cos(angle), np.sin(angle)
    out = x.copy()
    if style == "neox":
        first, second = x[..., :half], x[..., half:2 * half]
        out[..., :half] = first * cos - second * sin
        out[..., half:2 * half] = second * cos + first * sin
    else:
        first, second = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = first * cos - second * sin
        out[..., 1:2 * half:2] = second * cos + first * sin
    return out


@jet("embedding", CPU, [(F, INT)] + [(q, INT) for q in QUANTIZED])
def embedding(table, ids, out=None):
    if isinstance(table, QTensor):
        return deliver(dequantize(table, rows=ids), "f32", out)
    return deliver(np.take(table, ids, axis=0), dtype_of(table), out)


@njit(cache=True, error_model="numpy")
def _append_rotated(cache, new, slots, positions, inv_freq, neox):
    """Keys new [rows, H, D] f32, rotated (as `_rope`), into their cache slots [slots, H, D] (f32, or
    f16 bits): one call where rope, then numpy's rounding scatter, took three."""
    rotated = np.empty_like(new)
    _rope(new, positions, inv_freq, neox, rotated)
    for r in range(new.shape[0]):
        for h in range(new.shape[1]):
            for d in range(new.shape[2]):
                cache[slots[r], h, d] = stored(rotated[r, h, d], cache[0, 0, 0])


KV_APPENDS = [(F, F, INT, *r) for r in ROPE_INPUTS] + [(c, "f32", INT, *r) for c in HALF for r in ROPE_INPUTS]


CODED_APPENDS = [("u8", F, INT, *r) for r in ROPE_INPUTS]


@jet("kv_append", CPU, [(*keys, *values) for keys in CODED_APPENDS for values in (("none", "none"), keys[:2])],
     struct={"codec": tuple(kv.CODECS)})
@jet("kv_append", CPU, [(*keys, *values) for keys in KV_APPENDS for values in (("none", "none"), keys[:2])],
     struct={"codec": ("none",)})
def kv_append(pages, new, slots, positions=None, inv_freq=None, v_pages=None, v_new=None, out=None, style="neox",
              codec="none"):
    """Write new rows into their slots in place (rotated first, given rope's inputs), and values into
    theirs if given; the returned tensors are the caches themselves. A compressed cache gets each
    head's row as its codec's bytes."""
    if v_pages is not None:
        return (kv_append(pages, new, slots, positions, inv_freq, style=style, codec=codec),
                kv_append(v_pages, v_new, slots, codec=codec))
    flat = pages.reshape(-1, *pages.shape[2:])
    if codec != "none":
        rows = rope(new, positions, inv_freq, style=style) if positions is not None else new
        flat[slots.reshape(-1)] = kv.encode(codec, f32(rows).reshape(-1, *rows.shape[-2:]))
        return pages
    if positions is not None and all_f32(new) and new.ndim == 3 and positions.shape == new.shape[:1]:
        cache = flat.view(np.uint16) if flat.dtype == np.float16 else flat      # numba has no float16: its bits
        if cache.dtype in (np.uint16, np.float32):
            _append_rotated(cache, dense(new), dense(slots.reshape(-1)), dense(positions), dense(inv_freq), style == "neox")
            return pages
    if positions is not None:
        new = rope(new, positions, inv_freq, style=style)
    rows = new.reshape(-1, *pages.shape[2:])
    if rows.shape[0] == 1:                  # decode: one row, where fancy indexing's setup dominates
        flat[int(slots.reshape(-1)[0])] = rows[0]
    else:
        flat[slots.reshape(-1)] = rows      # numpy rounds to the cache's dtype
    return pages


@jet("kv_read", CPU, [("u8", INT)], struct={"codec": tuple(kv.CODECS)})
@jet("kv_read", CPU, [(F, INT)], struct={"codec": ("none",)})
def kv_read(pages, slots, out=None, codec="none"):
    flat = pages.reshape(-1, *pages.shape[2:])
    if codec != "none":
        return deliver(kv.decode(codec, np.take(flat, slots, axis=0)), "f32", out)
    if out is not None:
        return np.take(flat, slots, axis=0, out=out)
    return np.take(flat, slots, axis=0)

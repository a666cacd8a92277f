"""CPU jet for `lora_apply`: each row's low-rank update from its own adapter's factors. A few rows (decode
steps) run in one parallel pass over the rows (Punica's BGMV), each reading its adapter's factors; many
rows (prompts) are grouped by adapter, each group's two products through BLAS, so an adapter's factors
are read once per group rather than once per row. A row of no adapter is only copied (plus its residual).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from soma_runtime.backends.cpu.common import CPU, INT, F, deliver, dense, f32, out_f32
from soma_runtime.backends.cpu.linear import SMALL_ROWS
from soma_runtime.dtypes import dtype_of
from soma_runtime.ir.jets import jet


@njit(parallel=True, fastmath={"reassoc", "contract", "nsz"}, cache=True)
def _lora_rows(y, x, a, b, index, scale, magnitude, residual, norm, eps, down, out):
    """Row s: down = scale * a[i] x (rank dots along the input; x rms-normalized first where a `norm` weight
    is given), then each output y + b[i][n] . down, both contiguous reductions (b as PEFT stores it, [out,
    rank]); times DoRA's magnitude, plus the residual, where given (empty arrays where not)."""
    rank, gained, normed, joined = a.shape[1], magnitude.shape[0] > 0, norm.shape[0] > 0, residual.shape[0] > 0
    for s in prange(y.shape[0]):
        i = index[s]
        if i < 0:
            for n in range(out.shape[1]):
                out[s, n] = y[s, n] + residual[s, n] if joined else y[s, n]
            continue
        inv = np.float32(1)
        if normed:
            ms = np.float32(0)
            for k in range(x.shape[1]):
                ms += x[s, k] * x[s, k]
            inv = np.float32(1) / np.sqrt(ms / x.shape[1] + eps)
        h = down[s]
        for r in range(rank):
            ar = a[i, r]
            acc = np.float32(0)
            if normed:
                for k in range(ar.size):
                    acc += x[s, k] * norm[k] * ar[k]
            else:
                for k in range(ar.size):
                    acc += x[s, k] * ar[k]
            h[r] = acc * inv * scale[s]
        bi = b[i]
        for n in range(out.shape[1]):
            acc = np.float32(0)
            for r in range(rank):
                acc += h[r] * bi[n, r]
            v = y[s, n] + acc
            v = v * magnitude[i, n] if gained else v
            out[s, n] = v + residual[s, n] if joined else v


NONE_2D, NONE_1D = np.zeros((0, 0), np.float32), np.zeros(0, np.float32)


def grouped(y, x, a, b, index, scale, magnitude, residual, norm, eps, out):
    """The many-rows path: x normalized once, then per adapter of the batch its rows' products by BLAS."""
    if norm is not None:
        x = x * (1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * norm
    out[...] = y
    for i in np.unique(index[index >= 0]):
        rows = np.flatnonzero(index == i)
        update = ((x[rows] @ a[i].T) * scale[rows, None]) @ b[i].T
        out[rows] += update
        if magnitude is not None:
            out[rows] *= magnitude[i]
    if residual is not None:
        out += residual
    return out


@jet("lora_apply", CPU, [(F, F, F, F, INT, "f32", m, r, w) for m in ("none", "f32") for r in ("none", F) for w in ("none", F)])
def lora_apply(y, x, a, b, index, scale, magnitude=None, residual=None, norm=None, out=None, norm_eps=1e-6):
    rows = out_f32(out, y.shape)
    if y.shape[0] > SMALL_ROWS:
        grouped(f32(y), f32(x), f32(a), f32(b), index, scale, magnitude, None if residual is None else f32(residual),
                None if norm is None else f32(norm), np.float32(norm_eps), rows)
        return deliver(rows, dtype_of(y), out)
    _lora_rows(dense(f32(y)), dense(f32(x)), dense(f32(a)), dense(f32(b)), index.astype(np.int64, copy=False), scale,
               NONE_2D if magnitude is None else dense(magnitude), NONE_2D if residual is None else dense(f32(residual)),
               NONE_1D if norm is None else dense(f32(norm)), np.float32(norm_eps),
               np.empty((y.shape[0], a.shape[1]), np.float32), rows)
    return deliver(rows, dtype_of(y), out)

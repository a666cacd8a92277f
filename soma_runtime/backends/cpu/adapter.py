"""CPU jet for `lora_apply`: each row's low-rank update from its own adapter's factors, all adapters of a
batch in one parallel pass over the rows (Punica's BGMV); a row of no adapter is only copied.

A row's numbers depend on its adapter alone, never on the rows beside it (a batch gives each row its
solo output), so prompts and decode steps take the same per-row path.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from soma_runtime.backends.cpu.common import CPU, INT, F, deliver, dense, f32, out_f32
from soma_runtime.dtypes import dtype_of
from soma_runtime.ir.jets import jet


@njit(parallel=True, fastmath={"reassoc", "contract", "nsz"}, cache=True)
def _lora_rows(y, x, a, b, index, scale, magnitude, down, out):
    """Row s: down = scale * a[i] x (rank dots along the input), then each output y + b[i][n] . down, both
    contiguous reductions (b as PEFT stores it, [out, rank]); times DoRA's magnitude where given."""
    rank, gained = a.shape[1], magnitude.shape[0] > 0
    for s in prange(y.shape[0]):
        i = index[s]
        if i < 0:
            out[s] = y[s]
            continue
        h = down[s]
        for r in range(rank):
            ar = a[i, r]
            acc = np.float32(0)
            for k in range(ar.size):
                acc += x[s, k] * ar[k]
            h[r] = acc * scale[s]
        bi = b[i]
        for n in range(out.shape[1]):
            acc = np.float32(0)
            for r in range(rank):
                acc += h[r] * bi[n, r]
            v = y[s, n] + acc
            out[s, n] = v * magnitude[i, n] if gained else v


NO_MAGNITUDE = np.zeros((0, 0), np.float32)


@jet("lora_apply", CPU, [(F, F, F, F, INT, "f32", m) for m in ("none", "f32")])
def lora_apply(y, x, a, b, index, scale, magnitude=None, out=None):
    rows = out_f32(out, y.shape)
    _lora_rows(dense(f32(y)), dense(f32(x)), dense(f32(a)), dense(f32(b)), index.astype(np.int64, copy=False), scale,
               NO_MAGNITUDE if magnitude is None else dense(magnitude), np.empty((y.shape[0], a.shape[1]), np.float32), rows)
    return deliver(rows, dtype_of(y), out)

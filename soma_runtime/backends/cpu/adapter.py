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
def _lora_rows(y, x, a, b, index, scale, magnitude, out):
    rank = a.shape[1]
    for s in prange(y.shape[0]):
        out[s] = y[s]
        i = index[s]
        if i < 0:
            continue
        for r in range(rank):
            ar = a[i, r]
            h = np.float32(0)
            for k in range(ar.size):
                h += x[s, k] * ar[k]
            h *= scale[s]
            br = b[i, r]
            for n in range(br.size):
                out[s, n] += h * br[n]
        if magnitude.shape[0]:
            for n in range(out.shape[1]):
                out[s, n] *= magnitude[i, n]


NO_MAGNITUDE = np.zeros((0, 0), np.float32)


@jet("lora_apply", CPU, [(F, F, F, F, INT, "f32", m) for m in ("none", "f32")])
def lora_apply(y, x, a, b, index, scale, magnitude=None, out=None):
    rows = out_f32(out, y.shape)
    _lora_rows(dense(f32(y)), dense(f32(x)), dense(f32(a)), dense(f32(b)), index.astype(np.int64, copy=False), scale,
               NO_MAGNITUDE if magnitude is None else dense(magnitude), rows)
    return deliver(rows, dtype_of(y), out)

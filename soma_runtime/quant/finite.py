"""Whether a stored tensor holds a NaN or an infinity: for floats every value, for block formats
every block's f16 fields (a quant is an integer; only a scale can be non-finite). Read in one
parallel pass over the raw bits, so a load pays about one read of its weights for the check."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from soma_runtime.dtypes import F16_FIELDS, QTensor

# exponent bits of the float formats, all set in an Inf or a NaN, by the unsigned word they fit
EXPONENT = {"float16": (np.uint16, 0x7C00), "bfloat16": (np.uint16, 0x7F80), "float32": (np.uint32, 0x7F800000),
            "float64": (np.uint64, 0x7FF0000000000000)}
F16_HIGH_EXPONENT = 0x7C            # an f16's exponent bits within its high (second) byte


@njit(parallel=True, cache=True)
def _words_nonfinite(words, mask) -> int:
    bad = 0
    for i in prange(words.size):
        bad += (words[i] & mask) == mask
    return bad


@njit(parallel=True, cache=True)
def _fields_nonfinite(blocks, offsets) -> int:
    bad = 0
    for i in prange(blocks.shape[0]):
        for j in range(offsets.size):
            bad += (blocks[i, offsets[j] + 1] & F16_HIGH_EXPONENT) == F16_HIGH_EXPONENT
    return bad


def nonfinite(tensor) -> bool:
    """True where some value (or block scale) of `tensor` is a NaN or an infinity; integers never are."""
    if isinstance(tensor, QTensor):
        offsets = F16_FIELDS.get(tensor.dtype.name)
        if offsets is None or tensor.data.size == 0:
            return False
        blocks = tensor.data.reshape(-1, tensor.dtype.type_size)
        return _fields_nonfinite(blocks, np.asarray(offsets, np.int64)) > 0
    array = np.asarray(tensor)
    word = EXPONENT.get(array.dtype.name)
    if word is None or array.size == 0:
        return False
    kind, mask = word
    return _words_nonfinite(np.ascontiguousarray(array).reshape(-1).view(kind), kind(mask)) > 0

"""The paged KV cache: every layer's K and V live in fixed-size pages drawn from one pool.

A sequence owns a block table (its pages, in order); token position p lives in slot
`table[p // block] * block + p % block`. Page 0 is never handed out: padded context slots point
there, and attention masks them out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from soma_runtime.dtypes import DTYPES
from soma_runtime.errors import RequestError


@dataclass
class Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0                   # tokens whose K/V are in the cache


class KVPool:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_tokens: int, block: int = 16,
                 dtype: str = "f32"):
        self.block, self.dtype = block, dtype
        self.num_pages = -(-max_tokens // block) + 1
        shape = (self.num_pages, block, kv_heads, head_dim)
        # np.zeros maps pages lazily: memory grows with the tokens actually cached
        np_dtype = DTYPES[dtype].numpy
        self.k = [np.zeros(shape, np_dtype) for _ in range(num_layers)]
        self.v = [np.zeros(shape, np_dtype) for _ in range(num_layers)]
        self.free = list(range(self.num_pages - 1, 0, -1))

    def reserve(self, seq: Sequence, total_tokens: int) -> None:
        need = -(-total_tokens // self.block) - len(seq.pages)
        if need > len(self.free):
            raise RequestError(f"KV cache full: {total_tokens} tokens need {need} more pages, {len(self.free)} free")
        seq.pages.extend(self.free.pop() for _ in range(max(0, need)))

    def slots(self, seq: Sequence, start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, stop)
        return np.asarray(seq.pages, np.int64)[pos // self.block] * self.block + pos % self.block

    def release(self, seq: Sequence) -> None:
        self.free.extend(reversed(seq.pages))
        seq.pages, seq.length = [], 0

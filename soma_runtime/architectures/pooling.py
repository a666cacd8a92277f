"""How an encoder's token states become one embedding: sentence-transformers' Pooling config (mean,
cls, max, last token), then an optional L2 normalization (its Normalize module)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Pooling:
    mode: str = "mean"            # mean | cls | max | last
    normalize: bool = False

    @classmethod
    def from_sentence_transformers(cls, config: dict, normalize: bool) -> Pooling:
        for key, mode in (("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"),
                          ("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean")):
            if config.get(key):
                return cls(mode, normalize)
        return cls("mean", normalize)

    def __call__(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """hidden [B, S, D], mask [B, S] (1 for tokens) -> [B, D]."""
        if self.mode == "cls":
            out = hidden[:, 0]
        elif self.mode == "last":
            out = hidden[np.arange(len(hidden)), mask.sum(1).astype(np.int64) - 1]
        elif self.mode == "max":
            out = np.where(mask[..., None] > 0, hidden, -np.inf).max(1)
        else:
            m = mask[..., None].astype(np.float32)
            out = (hidden * m).sum(1) / np.maximum(m.sum(1), np.float32(1e-9))
        if self.normalize:
            out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), np.float32(1e-12))
        return out.astype(np.float32)

"""Block encoders (f32 -> GGUF bytes) for the formats the runtime writes: q8_0, q4_0, q4_1.

Each mirrors ggml's `quantize_row_*_ref` step for step in f32, so the bytes are identical to
what llama.cpp and the `gguf` package produce. Input: f32 blocks [n_blocks, 32].
"""
from __future__ import annotations

import numpy as np


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf, exactly: numpy's round is half-to-even and `floor(a + 0.5)` can round up twice."""
    a = np.abs(v)
    f = np.floor(a)
    return np.sign(v) * (f + (a - f >= 0.5))


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Element j goes to the low nibble of byte j, element j+16 to its high nibble."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def encode_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    q = _round_half_away(blocks * _inverse(d)).astype(np.int8)
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)


def encode_q4_0(blocks: np.ndarray) -> np.ndarray:
    signed_max = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
    d = signed_max / np.float32(-8)
    q = np.trunc(blocks * _inverse(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=1)


def encode_q4_1(blocks: np.ndarray) -> np.ndarray:
    lo = blocks.min(axis=1, keepdims=True)
    d = (blocks.max(axis=1, keepdims=True) - lo) / np.float32(15)
    q = np.trunc((blocks - lo) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=1)


ENCODERS = {"q8_0": encode_q8_0, "q4_0": encode_q4_0, "q4_1": encode_q4_1}

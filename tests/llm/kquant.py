"""K-quant GGUFs for tests and benchmarks: soma (and gguf-py) have no K-quant encoder, so a q4_0 GGUF's
matrices are rewritten as q4_K / q5_K / q6_K blocks, mixed as llama.cpp's Q4_K_M / Q5_K_M mix them.

The encoders here are plain min/max fits, not ggml's searched ones: valid blocks that decode close to
the weights (a model that still means something), not byte-identical to llama.cpp's files."""
from __future__ import annotations

import gguf
import numpy as np

from soma_runtime.dtypes import QTensor, dequantize

Q4_K, Q5_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K


def _f16(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float16).astype(np.float32)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float16).view(np.uint8).reshape(-1, 2)


def _scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per superblock [S, 8] -> ggml's 12-byte packing (get_scale_min_k4)."""
    out = np.empty((len(sc), 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _min_max_blocks(x: np.ndarray, levels: int):
    """Superblocks x [S, 256] -> (d, dmin as f16 values [S], scales, mins [S, 8] uint8, quants [S, 256])."""
    sub = x.reshape(len(x), 8, 32)
    low = np.minimum(sub.min(axis=2), 0)
    step = (sub.max(axis=2) - low) / levels
    d, dmin = _f16(step.max(axis=1) / 63), _f16(-low.min(axis=1) / 63)
    sc = np.clip(np.rint(step / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    scale, offset = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.rint((sub + offset[:, :, None]) / np.where(scale == 0, 1, scale)[:, :, None]), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q.reshape(len(x), 256)


def encode_q4_K(x: np.ndarray) -> np.ndarray:
    """[S, 256] f32 -> [S, 144] q4_K blocks: d, dmin, scales, then per 64 weights 32 bytes (low nibbles
    the first 32, high nibbles the next)."""
    d, dmin, sc, mn, q = _min_max_blocks(x, 15)
    chunks = q.reshape(len(x), 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(len(x), 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scale_bytes(sc, mn), qs], axis=1)


def encode_q5_K(x: np.ndarray) -> np.ndarray:
    """[S, 256] -> [S, 176] q5_K blocks: q4_K's fields with 32 bytes of fifth bits (bit j of byte l: weight
    32 j + l) before the low nibbles."""
    d, dmin, sc, mn, q = _min_max_blocks(x, 31)
    chunks = (q & 15).reshape(len(x), 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(len(x), 128)
    qh = ((q >> 4).reshape(len(x), 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scale_bytes(sc, mn), qh, qs], axis=1)


def encode_q6_K(x: np.ndarray) -> np.ndarray:
    """[S, 256] -> [S, 210] q6_K blocks: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales
    (one per 16 weights), d; a weight is d * scale * (q - 32)."""
    sub = x.reshape(len(x), 16, 16)
    step = np.abs(sub).max(axis=2) / 31
    d = _f16(step.max(axis=1) / 127)
    sc = np.clip(np.rint(step / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int8)
    scale = d[:, None] * sc
    q = np.clip(np.rint(sub / np.where(scale == 0, 1, scale)[:, :, None]) + 32, 0, 63).astype(np.uint8)
    quarters = q.reshape(len(x), 2, 4, 32)                          # halves of 128: four runs of 32
    ql = np.concatenate([(quarters[:, :, 0] & 15) | ((quarters[:, :, 2] & 15) << 4),
                         (quarters[:, :, 1] & 15) | ((quarters[:, :, 3] & 15) << 4)], axis=2).reshape(len(x), 128)
    qh = sum((quarters[:, :, i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8).reshape(len(x), 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


ENCODERS = {Q4_K: encode_q4_K, Q5_K: encode_q5_K, Q6_K: encode_q6_K}


def random_blocks(kind, superblocks: int, rng) -> np.ndarray:
    """Random valid blocks with small scales (a benchmark's weights: speed does not depend on values)."""
    size = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[kind]
    blocks = rng.integers(0, 256, (superblocks, size), dtype=np.uint8)
    scale = _f16_bytes(np.full(superblocks, 2e-5))
    if kind == Q6_K:
        blocks[:, 192:208] = rng.integers(-20, 21, (superblocks, 16)).astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = scale
    else:
        blocks[:, 0:2], blocks[:, 2:4] = scale, scale
    return blocks


def k_quant_gguf(source: str, path: str, mains=(Q4_K,), encode: bool = True) -> str:
    """The q4_0 GGUF at `source` with its matrices as K-quant blocks, mixed as llama.cpp's Q4_K_M (mains
    q4_K) or Q5_K_M (q5_K) mix them: q6_K for the output and every other layer's attn_v and ffn_down,
    elsewhere layer i's `mains[i % len(mains)]`. `encode` fits the weights (decoded from q4_0); else
    random blocks."""
    rng = np.random.default_rng(0)
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(path, str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            writer.add_key_value(name, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_0:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
        six = t.name == "output.weight" or (t.name.endswith(("attn_v.weight", "ffn_down.weight")) and layer % 2 == 0)
        kind = Q6_K if six else mains[layer % len(mains)]
        if encode:
            weights = dequantize(QTensor(np.asarray(t.data).reshape(-1), "q4_0", (rows, cols)))
            blocks = ENCODERS[kind](weights.reshape(-1, 256))
        else:
            blocks = random_blocks(kind, rows * cols // 256, rng)
        writer.add_tensor(t.name, blocks.reshape(rows, -1), raw_shape=blocks.reshape(rows, -1).shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""Compressed KV cache rows: what a `kv_dtype` spec means, and the codecs that store a head's vector.

A compressed layer keeps each key or value head vector [D] as bytes [row_bytes(D)], 32 elements a
block (D must be a multiple of 32):
  q8_0, q4_0   ggml's blocks (dtypes.py), byte-identical to llama.cpp's quantized caches
  tq4/tq3/tq2  TurboQuant's first stage: the vector is rotated first (by the graph: `rotation`, a
               Walsh-Hadamard transform with random signs, so every coordinate is near-Gaussian), then
               each coordinate is coded at 4/3/2 bits by the Lloyd-Max quantizer of that distribution
               over the block's largest magnitude, and the block keeps one f16 scale, the least-squares
               one for its codes. Keys are rotated less their layer's center (PagedKV.key_center).
               Block: d f16, then the codes: tq4 16 B of nibbles (el j low nibble of byte j%16, el
               j+16 high), tq3 8 B of low 2 bits (el j at byte j%8, bits 2*(j//8)) and 4 B of high bits
               (el j at byte j//8, bit j%8), tq2 8 B as tq3's low bits.
  tq3j/tq2j    with QJL (behind a flag): tq at one bit fewer, then the residual r's 1-bit
               Johnson-Lindenstrauss sketch: the signs of G r (G = H diag(s), a 32-point Hadamard
               transform after fixed random signs) and |r| in f16, decoded as sqrt(pi/2) |r| / 32 G^T
               signs, which makes the inner product's estimate of <q, r> unbiased. Block: tq's, then
               |r| f16 and 4 B of signs (el j at byte j//8, bit j%8).

Every codec codes vectors in the rotated basis (llama.cpp rotates its quantized caches alike): an outlier
channel no longer sets every block's scale.

A spec is `K[/V][,edges=N][,sinks=N][,window=N]`: one kind for keys and values, or each its own (keys
need more bits: tq4/tq2), with the first and last N layers kept in f16; `sinks` and `window` keep f16
copies beside the codes of a sequence's first N positions (StreamingLLM's attention sinks) and of the N
positions up to each query's own (KIVI's full-precision window), which attention reads instead of the
codes (engine/kv.py holds them). Kinds: f32, f16, bf16 and the codecs above; `kv4` and `kv3` (PRESETS)
name tq4 and tq3 with sinks and a window: 4.5 and 3.5 bits a value past the window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from soma_runtime.dtypes import dtype
from soma_runtime.quant import quantize
from soma_runtime.quant.formats import F16_TABLE, _f16, _row_q4_0, _row_q8_0, dequantize_rows

BLOCK = 32
SINKS_MAX = 16          # a sequence's sinks lie in its first page (engine/kv.py: 16 positions)
FLOAT_KINDS = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class Codec:
    name: str
    type_size: int      # bytes per 32-element block
    bits: int           # code bits per element (tq*: Lloyd-Max levels = 2**bits)
    qjl: bool = False   # a residual sign bit per element follows the codes

    def row_bytes(self, dim: int) -> int:
        if dim % BLOCK:
            raise ValueError(f"a {self.name} KV cache needs a head dim that is a multiple of {BLOCK}, got {dim}")
        return dim // BLOCK * self.type_size

    def dim(self, row_bytes: int) -> int:
        return row_bytes // self.type_size * BLOCK

    @property
    def tq(self) -> bool:
        """Coded by TurboQuant's levels (else one of ggml's blocks)."""
        return self.name.startswith("tq")


CODECS = {c.name: c for c in (Codec("q8_0", 34, 8), Codec("q4_0", 18, 4), Codec("tq4", 18, 4), Codec("tq3", 14, 3),
                              Codec("tq2", 10, 2), Codec("tq3j", 16, 2, True), Codec("tq2j", 12, 1, True))}
KINDS = (*FLOAT_KINDS, *CODECS)
CODEC_IDS = {name: i for i, name in enumerate(CODECS)}


# The codebooks: Lloyd-Max quantizers for the rotated coordinates' distribution (N(0, 1) samples over
# the largest magnitude of their 32-block: the block's range is known, which beats N(0, 1)'s own
# Lloyd-Max levels at 4 and 3 bits), drawn from an odd quintic, level = u (a + u^2 (b + c u^2)) at
# u = (2 code - (L - 1)) / (L - 1), so that a kernel computes a level instead of looking it up (a lookup
# per element cost a GPU kernel 2.4x). Fitted by Lloyd's iteration within that family (`derive_curve`):
# within 0.003 of the unconstrained Lloyd-Max levels (a cubic was 0.013 off at 4 bits, and 1.7% worse
# in perplexity). A block whose coordinates are far from Gaussian (a key dominated by one channel
# rotates into near-equal magnitudes) is coded with uniform levels (1, 0, 0) instead, whichever is
# closer; the scale's sign bit says which.
CURVES = {1: (0.3477, 0.0, 0.0), 2: (0.5806, 0.0841, 0.0), 3: (0.7112, 0.0994, 0.0712), 4: (0.7574, 0.1002, 0.1115)}
UNIFORM = (1.0, 0.0, 0.0)


def curve_levels(bits: int, a: float, b: float, c: float) -> np.ndarray:
    """The 2**bits levels of the curve (a, b, c), in f32 as the kernels compute them."""
    levels = 2 ** bits
    u = (2 * np.arange(levels, dtype=np.float32) - np.float32(levels - 1)) * np.float32(1 / max(1, levels - 1))
    square = u * u
    return u * (np.float32(a) + square * (np.float32(b) + np.float32(c) * square))


CODEBOOKS = {bits: (curve_levels(bits, *curve), curve_levels(bits, *UNIFORM)) for bits, curve in CURVES.items()}


def derive_curve(bits: int, blocks: int = 40000, seed: int = 0, iterations: int = 100) -> tuple[float, float, float]:
    """Lloyd's iteration within the odd polynomials (as many terms as a half has levels, at most three)
    over Gaussian 32-blocks divided by their largest magnitude: each value to its nearest level, then the
    terms refitted by least squares: CURVES' entries."""
    x = np.random.default_rng(seed).standard_normal((blocks, BLOCK))
    values = np.sort((x / np.abs(x).max(axis=1, keepdims=True)).ravel())
    levels = 2 ** bits
    u = (2 * np.arange(levels) - (levels - 1)) / max(1, levels - 1)
    terms = min(3, levels // 2)
    powers = lambda t: np.stack([t ** (2 * k + 1) for k in range(terms)], axis=1)
    coefficients = np.array(CURVES[bits][:terms])
    for _ in range(iterations):
        book = powers(u) @ coefficients
        at = u[np.searchsorted((book[1:] + book[:-1]) / 2, values)]
        coefficients = np.linalg.lstsq(powers(at), values, rcond=None)[0]
    return tuple(float(v) for v in coefficients) + (0.0,) * (3 - terms)


def rotation(dim: int, seed: int = 0) -> np.ndarray:
    """An orthogonal [dim, dim] matrix rows are rotated by (x @ R): a Walsh-Hadamard transform after
    random signs (fixed by the seed) when dim is a power of two, else a random orthogonal matrix."""
    rng = np.random.default_rng(seed)
    if dim & (dim - 1):
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        return (q * np.sign(np.diag(r))).astype(np.float32)
    h = np.ones((1, 1))
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    signs = rng.choice([-1.0, 1.0], dim)
    return (signs[:, None] * h / math.sqrt(dim)).astype(np.float32)


SKETCH = (rotation(BLOCK, seed=1) * math.sqrt(BLOCK)).astype(np.float32)   # G: entries +-1, G^T G = 32 I
QJL_GAIN = np.float32(math.sqrt(math.pi / 2) / BLOCK)


def _codes(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes of f32 blocks [n, 32] over each block's largest magnitude, in whichever of the two codebooks
    fits the block better, and each block's least-squares scale, its sign bit naming the codebook."""
    top = np.abs(blocks).max(axis=1, keepdims=True)
    unit = blocks / np.where(top == 0, 1, top)
    best = None
    for book in CODEBOOKS[bits]:
        codes = np.searchsorted((book[1:] + book[:-1]) / 2, unit).astype(np.uint8)
        levels = book[codes].astype(np.float64)
        energy = np.sum(levels * levels, axis=1, keepdims=True)
        scale = np.where(top == 0, 0, np.sum(blocks * levels, axis=1, keepdims=True) / np.where(energy == 0, 1, energy))
        error = np.sum((blocks - scale * levels) ** 2, axis=1, keepdims=True)
        if best is None:
            best = codes, scale, error
            continue
        better = error < best[2]
        best = np.where(better, codes, best[0]), np.where(better, -scale, best[1]), None
    codes, scale, _ = best
    return codes, scale.astype(np.float16)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [n, 32] as bytes (the layouts in the module docstring)."""
    if bits == 4:
        return (codes[:, :16] | codes[:, 16:] << 4).astype(np.uint8)
    if bits == 1:
        return np.packbits(codes.astype(np.uint8), axis=1, bitorder="little")
    low = codes & 3
    packed = low[:, 0:8] | low[:, 8:16] << 2 | low[:, 16:24] << 4 | low[:, 24:32] << 6
    if bits == 2:
        return packed.astype(np.uint8)
    return np.concatenate([packed, np.packbits(codes >> 2, axis=1, bitorder="little")], axis=1).astype(np.uint8)


def _unpack(data: np.ndarray, bits: int) -> np.ndarray:
    if bits == 4:
        return np.concatenate([data & 15, data >> 4], axis=1)
    if bits == 1:
        return np.unpackbits(data, axis=1, bitorder="little")
    low = np.concatenate([data[:, :8] >> s & 3 for s in (0, 2, 4, 6)], axis=1)
    return low if bits == 2 else low | np.unpackbits(data[:, 8:12], axis=1, bitorder="little") << 2


def _f16_at(data: np.ndarray, at: int) -> np.ndarray:
    return F16_TABLE[data[:, at].astype(np.int64) | data[:, at + 1].astype(np.int64) << 8][:, None]


def _tq_encode(blocks: np.ndarray, codec: Codec) -> np.ndarray:
    codes, scale = _codes(blocks, codec.bits)
    parts = [scale.view(np.uint8), _pack(codes, codec.bits)]
    if codec.qjl:
        books = np.stack(CODEBOOKS[codec.bits])[(scale[:, 0] < 0).astype(np.int64)]
        residual = blocks - np.abs(scale.astype(np.float32)) * np.take_along_axis(books, codes.astype(np.int64), axis=1)
        parts += [np.linalg.norm(residual, axis=1, keepdims=True).astype(np.float16).view(np.uint8),
                  np.packbits(residual @ SKETCH.T > 0, axis=1, bitorder="little")]
    return np.concatenate(parts, axis=1)


def _tq_decode(data: np.ndarray, codec: Codec) -> np.ndarray:
    code_bytes = BLOCK * codec.bits // 8
    scale = _f16_at(data, 0)
    books = np.stack(CODEBOOKS[codec.bits])[(scale[:, 0] < 0).astype(np.int64)]
    out = np.abs(scale) * np.take_along_axis(books, _unpack(data[:, 2:2 + code_bytes], codec.bits).astype(np.int64), axis=1)
    if codec.qjl:
        at = 2 + code_bytes
        signs = np.unpackbits(data[:, at + 2:at + 6], axis=1, bitorder="little").astype(np.float32) * 2 - 1
        out += _f16_at(data, at) * QJL_GAIN * (signs @ SKETCH)
    return out


def kernel_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `decode_row` reads besides the bytes: each codec's (bits, type size, qjl) [codecs, 3], the
    codebooks [5, 2, 16] ([b, i]: the b-bit codebook i) and the QJL sketch G [32, 32]."""
    spec = np.array([[c.bits, c.type_size, c.qjl] for c in CODECS.values()], np.int64)
    books = np.zeros((5, 2, 16), np.float32)
    for bits, pair in CODEBOOKS.items():
        for i, book in enumerate(pair):
            books[bits, i, :len(book)] = book
    return spec, books, SKETCH


@njit(cache=True)
def decode_row(codec, src, out, lut, spec, books, sketch):
    """Decode one head's bytes `src` of codec number `codec` (CODEC_IDS) into f32 `out` [D]: the kernels'
    decoder (the numpy `decode` above is the reference's)."""
    if codec == 0:
        _row_q8_0(src, out, lut)
        return
    if codec == 1:
        _row_q4_0(src, out, lut)
        return
    bits, size, qjl = spec[codec, 0], spec[codec, 1], spec[codec, 2]
    for b in range(out.size // BLOCK):
        o, e = b * size, b * BLOCK
        d = _f16(src, o, lut)
        book = books[bits, 1 if d < 0 else 0]
        d = abs(d)
        for j in range(BLOCK):
            if bits == 4:
                code = (src[o + 2 + j % 16] >> (4 * (j // 16))) & 15
            elif bits == 1:
                code = (src[o + 2 + j // 8] >> (j % 8)) & 1
            else:
                code = (src[o + 2 + j % 8] >> (2 * (j // 8))) & 3
                if bits == 3:
                    code |= ((src[o + 10 + j // 8] >> (j % 8)) & 1) << 2
            out[e + j] = d * book[code]
        if qjl:
            at = o + 2 + BLOCK * bits // 8
            norm = _f16(src, at, lut) * QJL_GAIN
            for i in range(BLOCK):
                sign = norm if (src[at + 2 + i // 8] >> (i % 8)) & 1 else -norm
                for j in range(BLOCK):
                    out[e + j] += sign * sketch[i, j]


def encode(kind: str, x: np.ndarray) -> np.ndarray:
    """Vectors [..., D] (f32) as a codec's bytes [..., row_bytes(D)]."""
    codec = CODECS[kind]
    x = np.ascontiguousarray(x, np.float32)
    shape = x.shape
    blocks = x.reshape(-1, BLOCK)
    data = quantize(blocks, kind).data if not codec.tq else _tq_encode(blocks, codec)
    return data.reshape(*shape[:-1], codec.row_bytes(shape[-1]))


def decode(kind: str, data: np.ndarray) -> np.ndarray:
    """Bytes [..., row_bytes] of a codec as f32 vectors [..., D]."""
    codec = CODECS[kind]
    data = np.ascontiguousarray(data, np.uint8)
    shape = data.shape
    blocks = data.reshape(-1, codec.type_size)
    out = dequantize_rows(blocks, dtype(kind).ggml_id, BLOCK) if not codec.tq else _tq_decode(blocks, codec)
    return out.reshape(*shape[:-1], codec.dim(shape[-1]))


@dataclass(frozen=True)
class Layout:
    """Each layer's (key kind, value kind), and what a compressed layer keeps in f16 besides its codes: the
    first `sinks` positions of a sequence and, for each query, the `window` positions up to its own."""
    kinds: tuple[tuple[str, str], ...]
    sinks: int = 0
    window: int = 0

    def float_copies(self, layer: int) -> bool:
        """Whether the layer keeps f16 copies of its sinks' and window's keys and values."""
        return bool(self.sinks or self.window) and self.kinds[layer][0] in CODECS


OPTIONS = {"edges": "keeps the first and last N layers f16",
           "sinks": f"keeps a sequence's first N positions f16 (N <= {SINKS_MAX})",
           "window": "keeps the N positions up to each query's own f16"}
PRESETS = {"kv4": "tq4,sinks=4,window=32", "kv3": "tq3,sinks=4,window=32"}


def layout(spec: str, layers: int) -> Layout:
    """Parse a `kv_dtype` spec (module docstring) for a model of `layers` layers; ValueError if malformed."""
    head, *options = PRESETS.get(str(spec), str(spec)).split(",")
    kinds = head.split("/")
    if not 1 <= len(kinds) <= 2 or any(k not in KINDS for k in kinds):
        raise ValueError(f"kv cache {spec!r}: want K[/V][,edges=N][,sinks=N][,window=N] with kinds from "
                         f"{', '.join(KINDS)} (or one of {', '.join(PRESETS)})")
    key, value = kinds[0], kinds[-1]
    if (key in CODECS) != (value in CODECS) or (key in FLOAT_KINDS and key != value):
        raise ValueError(f"kv cache {spec!r}: keys and values are both compressed or both in one float type")
    counts = dict.fromkeys(OPTIONS, 0)
    for option in options:
        name, _, count = (part.strip() for part in option.partition("="))
        if name not in OPTIONS or not count.isdigit():
            raise ValueError(f"kv cache {spec!r}: unknown option {option!r} "
                             f"({'; '.join(f'{n}=N {what}' for n, what in OPTIONS.items())})")
        counts[name] = int(count)
    if counts["sinks"] > SINKS_MAX or ((counts["sinks"] or counts["window"]) and key not in CODECS):
        raise ValueError(f"kv cache {spec!r}: sinks (at most {SINKS_MAX}) and window keep f16 copies beside a codec's pages")
    edges = counts["edges"]
    return Layout(tuple(("f16", "f16") if i < edges or i >= layers - edges else (key, value) for i in range(layers)),
                  counts["sinks"], counts["window"])


def rotated(kind: str) -> bool:
    """Whether a kind codes vectors in the rotated basis (the graph rotates them for it): every codec, as
    llama.cpp rotates its quantized caches (a key's outlier channels spread over its blocks)."""
    return kind in CODECS


def transcode(pages: np.ndarray, source: str, target: str, head_dim: int, centers=(None, None)) -> np.ndarray:
    """Cached vectors [..., heads, last] of kind `source` as kind `target` (a float type or a codec). A rotated
    codec holds (x - c) R: each vector x less its center c (`centers`: the source's and the target's,
    [heads, head_dim] or None), turned into the rotated basis R; values pass between bases as they must,
    and from one rotated kind to another only their centers' difference is added."""
    values = decode(source, pages) if source in CODECS else pages.astype(np.float32)
    source_center, target_center = (np.zeros(1, np.float32) if c is None else c for c in centers)
    if rotated(source) or rotated(target):
        basis = rotation(head_dim)
        if not rotated(source):
            values = (values - target_center) @ basis
        elif not rotated(target):
            values = values @ basis.T + source_center
        elif centers[0] is not centers[1]:
            values = values + (source_center - target_center) @ basis
    return encode(target, values) if target in CODECS else values.astype(dtype(target).numpy)


def to_basis(values: np.ndarray, kind: str, head_dim: int, center=None) -> np.ndarray:
    """Vectors [..., head_dim] in the basis a cache of `kind` codes them in: less their center (keys, or
    None) and rotated, for a rotated kind; as they are otherwise."""
    if not rotated(kind):
        return values
    return (values - (0 if center is None else center)) @ rotation(head_dim)


def page_meta(kind: str, head_dim: int) -> tuple[int, str]:
    """A page's last dim and dtype for a cache of this kind: D elements, or a codec's row bytes."""
    return (CODECS[kind].row_bytes(head_dim), "u8") if kind in CODECS else (head_dim, kind)


def bytes_per_token(kinds: list[tuple[str, str]], kv_heads: int, head_dim: int) -> int:
    """The cache's bytes for one token: the keys and values of layers of these (K, V) kinds."""
    def size(kind):
        last, dt = page_meta(kind, head_dim)
        return last * (1 if dt == "u8" else np.dtype(dtype(dt).numpy).itemsize)
    return sum(kv_heads * (size(k) + size(v)) for k, v in kinds)

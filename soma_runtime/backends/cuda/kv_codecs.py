"""Compressed KV caches on the GPU (quant/kv.py's codecs): rows encoded where they are appended (torch
ops on the device, capturable in a CUDA graph: no host round trip), and `decoded`, which the attention
kernel calls on each tile of a compressed page's bytes. QJL's kinds are not here: their sketch's
32 x 32 product per block would cost more than it is worth measuring on the device; they run on the host."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.device import CUDA, INT, F, device_jet
from soma_runtime.backends.cuda.rope import ROPE_INPUTS, rope
from soma_runtime.ir.jets import jet
from soma_runtime.quant import kv

ON_DEVICE = tuple(name for name, codec in kv.CODECS.items() if not codec.qjl)


@functools.cache
def books(where) -> torch.Tensor:
    """The tq codebooks [5, 2, 16] (quant/kv.py's kernel table) on the device."""
    return torch.from_numpy(kv.kernel_tables()[1]).to(where)


def codec_constants(codec: str) -> tuple[int, int, int]:
    """(codec number, code bits, block bytes) a kernel specializes on; (-1, 0, 0) for a float cache."""
    if codec == "none":
        return -1, 0, 0
    c = kv.CODECS[codec]
    return kv.CODEC_IDS[codec], c.bits, c.type_size


@triton.jit
def decoded(base_ptr, row, d, ok, row_bytes, books_ptr, CODEC: tl.constexpr, BITS: tl.constexpr, SIZE: tl.constexpr):
    """Elements d of cache rows `row` [BT] (row_bytes apart) of a compressed page, as f32 [BT, BD]."""
    block = row[:, None] * row_bytes + (d // 32)[None, :] * SIZE
    j = (d % 32)[None, :]
    low = tl.load(base_ptr + block, mask=ok, other=0).to(tl.int32)
    high = tl.load(base_ptr + block + 1, mask=ok, other=0).to(tl.int32)
    scale = (low | (high << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if CODEC == 0:                                   # q8_0
        code = tl.load(base_ptr + block + 2 + j, mask=ok, other=0).to(tl.int8, bitcast=True)
        return code.to(tl.float32) * scale
    if CODEC == 1:                                   # q4_0
        code = (tl.load(base_ptr + block + 2 + j % 16, mask=ok, other=0).to(tl.int32) >> (4 * (j // 16))) & 15
        return (code - 8).to(tl.float32) * scale
    if BITS == 4:
        code = (tl.load(base_ptr + block + 2 + j % 16, mask=ok, other=0).to(tl.int32) >> (4 * (j // 16))) & 15
    else:
        code = (tl.load(base_ptr + block + 2 + j % 8, mask=ok, other=0).to(tl.int32) >> (2 * (j // 8))) & 3
        if BITS == 3:
            code = code | (((tl.load(base_ptr + block + 10 + j // 8, mask=ok, other=0).to(tl.int32) >> (j % 8)) & 1) << 2)
    level = tl.load(books_ptr + (BITS * 2 + ((high >> 7) & 1)) * 16 + code, mask=ok, other=0.0)
    return tl.abs(scale) * level


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    a = v.abs()
    f = a.floor()
    return v.sign() * (f + (a - f >= 0.5).to(v.dtype))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 4:
        return codes[:, :16] | codes[:, 16:] << 4
    low = codes & 3
    packed = low[:, 0:8] | low[:, 8:16] << 2 | low[:, 16:24] << 4 | low[:, 24:32] << 6
    if bits == 2:
        return packed
    high = (codes >> 2).reshape(-1, 4, 8) << torch.arange(8, device=codes.device, dtype=torch.uint8)
    return torch.cat([packed, high.sum(-1, dtype=torch.uint8)], dim=1)


def _tq_blocks(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """As quant/kv.py's tq encoder: the better of the two codebooks per block, the scale's sign naming it."""
    top = blocks.abs().amax(1, keepdim=True)
    unit = blocks / torch.where(top == 0, torch.ones_like(top), top)
    best_codes = best_scale = best_error = None
    for book in books(blocks.device)[bits]:
        book = book[:2 ** bits]
        codes = torch.bucketize(unit, (book[1:] + book[:-1]) / 2).to(torch.uint8)
        levels = book[codes.long()].double()
        energy = (levels * levels).sum(1, keepdim=True)
        wide = blocks.double()
        scale = torch.where(top == 0, 0.0, (wide * levels).sum(1, keepdim=True) / energy.clamp_min(1e-30))
        error = ((wide - scale * levels) ** 2).sum(1, keepdim=True)
        if best_codes is None:
            best_codes, best_scale, best_error = codes, scale, error
        else:
            better = error < best_error
            best_codes, best_scale = torch.where(better, codes, best_codes), torch.where(better, -scale, best_scale)
    return torch.cat([_f16_bytes(best_scale), _pack(best_codes, bits)], dim=1)


def encode(codec: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows [..., D] (f32) as the codec's bytes [..., row_bytes(D)], byte for byte as quant/kv.py encodes."""
    blocks = rows.reshape(-1, 32).to(torch.float32)
    if codec == "q8_0":
        d = blocks.abs().amax(1, keepdim=True) / 127
        data = torch.cat([_f16_bytes(d), _round_half_away(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)], dim=1)
    elif codec == "q4_0":
        d = torch.gather(blocks, 1, blocks.abs().argmax(1, keepdim=True)) / -8
        codes = torch.trunc(blocks * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
        data = torch.cat([_f16_bytes(d), _pack(codes, 4)], dim=1)
    else:
        data = _tq_blocks(blocks, kv.CODECS[codec].bits)
    return data.reshape(*rows.shape[:-1], kv.CODECS[codec].row_bytes(rows.shape[-1]))


CODED_APPENDS = [("u8", F, INT, *r) for r in ROPE_INPUTS]


@jet("kv_append", CUDA, [(*keys, *values) for keys in CODED_APPENDS for values in (("none", "none"), keys[:2])],
     struct={"codec": ON_DEVICE})
@device_jet
def kv_append(pages, new, slots, positions=None, inv_freq=None, v_pages=None, v_new=None, style="neox", codec="none"):
    """Rows of `new` (rotated first, given rope's inputs) encoded into their slots of a compressed cache, in
    place; values into theirs if given."""
    if positions is not None:
        new = rope(new, positions, inv_freq, style=style)
    flat = pages.view(-1, *pages.shape[2:])
    flat.index_copy_(0, slots.reshape(-1), encode(codec, new.reshape(-1, *new.shape[-2:])))
    if v_pages is None:
        return pages
    return pages, kv_append(v_pages, v_new, slots, codec=codec)


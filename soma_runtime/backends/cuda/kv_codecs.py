"""Compressed KV caches on the GPU (quant/kv.py's codecs): rows encoded into their slots by one kernel,
byte for byte as the host encodes them (the least-squares sums in f64), and `decoded`, which the
attention kernel calls on each tile of a compressed page's bytes and kv_read on the rows it reads. QJL's
kinds are not here: their sketch's 32 x 32 product per block would cost more than it is worth measuring
on the device; they run on the host."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import CUDA, INT, F, device_jet
from soma_runtime.backends.cuda.rope import ROPE_INPUTS, rope
from soma_runtime.ir.jets import jet
from soma_runtime.quant import kv

ON_DEVICE = tuple(name for name, codec in kv.CODECS.items() if not codec.qjl)


@functools.cache
def books(where) -> torch.Tensor:
    """The tq codebooks [5, 2, 16] (quant/kv.py's kernel table) on the device: the encoder's levels."""
    return torch.from_numpy(kv.kernel_tables()[1]).to(where)


@functools.cache
def curves(where) -> torch.Tensor:
    """The tq codebooks' curves [5, 3] ((a, b, c) by code bits, quant/kv.py) on the device: the decoder's."""
    table = torch.zeros((5, 3), dtype=torch.float32)
    for bits, curve in kv.CURVES.items():
        table[bits] = torch.tensor(curve)
    return table.to(where)


def codec_constants(codec: str) -> tuple[int, int, int]:
    """(codec number, code bits, block bytes) a kernel specializes on; (-1, 0, 0) for a float cache."""
    if codec == "none":
        return -1, 0, 0
    c = kv.CODECS[codec]
    return kv.CODEC_IDS[codec], c.bits, c.type_size


def words(pages: torch.Tensor, codec: str) -> torch.Tensor:
    """A cache's pages as the attention kernel reads them: a float cache's as they are, a compressed
    cache's bytes as int16 words (its rows and blocks are an even number of bytes)."""
    pages = pages.contiguous()
    return pages if codec == "none" else pages.view(torch.int16)


@triton.jit
def _after(first, second):
    """[..., n] and [..., n] -> [..., 2n]: second's elements after first's."""
    both = tl.permute(tl.join(first, second), (0, 1, 3, 2))
    return tl.reshape(both, (first.shape[0], first.shape[1], 2 * first.shape[2]))


@triton.jit
def _pairs(first, second):
    """[..., n] and [..., n] -> [..., 2n], interleaved: first[0], second[0], first[1], ..."""
    return tl.reshape(tl.join(first, second), (first.shape[0], first.shape[1], 2 * first.shape[2]))


@triton.jit
def decoded(words_ptr, row, rows_ok, row_words, blocks, curves_ptr, CODEC: tl.constexpr, BITS: tl.constexpr,
            SIZE: tl.constexpr, NB: tl.constexpr):
    """Cache rows `row` [BT] of a compressed page (its bytes read as int16 words, row_words a row) as f32
    [BT, NB * 32]: a block's scale in one word, its codes a word per 2 bytes, unpacked in registers, a
    tq code's level computed from its curve (no lookup)."""
    b = tl.arange(0, NB)
    ok = rows_ok[:, None] & (b < blocks)[None, :]
    start = row[:, None].to(tl.int64) * row_words + b[None, :] * (SIZE // 2)                 # [BT, NB]
    scale_bits = tl.load(words_ptr + start, mask=ok, other=0)
    scale = scale_bits.to(tl.float16, bitcast=True).to(tl.float32)
    okw = ok[:, :, None]
    if CODEC == 0:                                            # q8_0: 16 words of signed bytes
        w = tl.load(words_ptr + start[:, :, None] + 1 + tl.arange(0, 16)[None, None, :], mask=okw, other=0).to(tl.int32)
        values = _pairs((w << 24) >> 24, w >> 8).to(tl.float32)
    elif BITS == 4:                                           # q4_0, tq4: el j low nibble of byte j, el j+16 high
        w = tl.load(words_ptr + start[:, :, None] + 1 + tl.arange(0, 8)[None, None, :], mask=okw, other=0).to(tl.int32)
        code = _after(_pairs(w & 15, (w >> 8) & 15), _pairs((w >> 4) & 15, (w >> 12) & 15))
        values = (code - 8).to(tl.float32) if CODEC == 1 else code
    else:                                                     # tq2, tq3: el j at byte j % 8, bits 2 (j // 8)
        w = tl.load(words_ptr + start[:, :, None] + 1 + tl.arange(0, 4)[None, None, :], mask=okw, other=0).to(tl.int32)
        byte = _pairs(w & 255, (w >> 8) & 255)
        code = _after(_after(byte & 3, (byte >> 2) & 3), _after((byte >> 4) & 3, (byte >> 6) & 3))
        if BITS == 3:                                         # the high bits: el j at byte 8 + j // 8, bit j % 8
            h = tl.load(words_ptr + start[:, :, None] + 5 + tl.arange(0, 2)[None, None, :], mask=okw, other=0).to(tl.int32)
            high = _pairs(h & 255, (h >> 8) & 255)
            bit = (high[:, :, :, None] >> tl.arange(0, 8)[None, None, None, :]) & 1
            code = code | (tl.reshape(bit, (bit.shape[0], bit.shape[1], 32)) << 2)
        values = code
    if CODEC >= 2:                                            # tq: on the curve the scale's sign names (else uniform)
        uniform = (scale_bits < 0)[:, :, None]
        a = tl.where(uniform, 1.0, tl.load(curves_ptr + 3 * BITS))
        b = tl.where(uniform, 0.0, tl.load(curves_ptr + 3 * BITS + 1))
        c = tl.where(uniform, 0.0, tl.load(curves_ptr + 3 * BITS + 2))
        u = (2 * values - (2 ** BITS - 1)).to(tl.float32) * (1.0 / (2 ** BITS - 1))
        square = u * u
        values = u * (a + square * (b + c * square))
        scale = tl.abs(scale)
    out = values * scale[:, :, None]
    return tl.reshape(out, (out.shape[0], NB * 32))


@chained
@triton.jit
def _encode_kernel(x_ptr, out_ptr, slots_ptr, books_ptr, x_stride, heads, dim, row_bytes, CODEC: tl.constexpr,
                   BITS: tl.constexpr, SIZE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """Block b of head h of row r of x into its cache slot's bytes, as quant/kv.py encodes it: the block's
    32 values laid out [R, C] (element j at j // C, j % C), so that each packed byte gathers one column."""
    r, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, cols = tl.arange(0, R)[:, None], tl.arange(0, C)[None, :]
    after_prior()
    x = tl.load(x_ptr + r * x_stride + h * dim + b * 32 + rows * C + cols).to(tl.float32)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    base = out_ptr + (slot * heads + h) * row_bytes + b * SIZE
    top = tl.max(tl.max(tl.abs(x), 1), 0)
    if CODEC == 0:                                           # q8_0: d = max |x| / 127, codes rounded half away
        d = top / 127
        inverse = tl.where(d == 0, 0.0, 1 / tl.where(d == 0, 1.0, d))
        v = x * inverse
        a = tl.abs(v)
        code = tl.where(v < 0, -1.0, 1.0) * (tl.floor(a) + tl.where(a - tl.floor(a) >= 0.5, 1.0, 0.0))
        tl.store(base + 2 + rows * C + cols, code.to(tl.int8).to(tl.uint8, bitcast=True))
    elif CODEC == 1:                                         # q4_0: d = the signed max / -8
        at = tl.argmax(tl.reshape(tl.abs(x), (R * C,)), 0)
        signed = tl.sum(tl.sum(tl.where(rows * C + cols == at, x, 0.0), 1), 0)
        d = signed / -8
        inverse = tl.where(d == 0, 0.0, 1 / tl.where(d == 0, 1.0, d))
        code = tl.minimum(tl.maximum(tl.floor(x * inverse + 8.5), 0.0), 15.0).to(tl.int32)
        tl.store(base + 2 + cols, tl.sum(code << (4 * rows), 0).to(tl.uint8))
    else:                                                    # tq: the closer of the two codebooks, least squares
        unit = x / tl.where(top == 0, 1.0, top)
        d = 0.0
        best_error = float("inf")
        best_code = tl.zeros((R, C), tl.int32)
        flag = 0
        for which in tl.static_range(2):
            book = books_ptr + (BITS * 2 + which) * 16
            code = tl.zeros((R, C), tl.int32)
            for k in tl.static_range(2 ** BITS - 1):         # codes: the midpoints below each value
                middle = (tl.load(book + k) + tl.load(book + k + 1)) / 2
                code += (middle < unit).to(tl.int32)
            level = tl.load(book + code).to(tl.float64)
            wide = x.to(tl.float64)
            energy = tl.sum(tl.sum(level * level, 1), 0)
            scale = tl.where(top == 0, 0.0, tl.sum(tl.sum(wide * level, 1), 0) / tl.where(energy == 0, 1.0, energy))
            error = tl.sum(tl.sum((wide - scale * level) * (wide - scale * level), 1), 0)
            better = error < best_error
            best_code = tl.where(better, code, best_code)
            d = tl.where(better, scale, d)
            best_error = tl.where(better, error, best_error)
            flag = tl.where(better, which, flag)
        d = tl.where(flag == 1, -d, d)
        if BITS == 4:
            tl.store(base + 2 + cols, tl.sum(best_code << (4 * rows), 0).to(tl.uint8))
        else:
            tl.store(base + 2 + cols, tl.sum((best_code & 3) << (2 * rows), 0).to(tl.uint8))
            if BITS == 3:
                tl.store(base + 10 + tl.arange(0, R), tl.sum(((best_code >> 2) & 1) << cols, 1).to(tl.uint8))
    bits = d.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    tl.store(base, (bits & 255).to(tl.uint8))
    tl.store(base + 1, ((bits >> 8) & 255).to(tl.uint8))


def encode_into(codec: str, pages: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows [n, heads, D] (any float) encoded into their slots of compressed pages [P, block, heads, row_bytes]."""
    number, bits, size = codec_constants(codec)
    n, heads, dim = rows.shape
    rows = rows.reshape(n, heads * dim)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    R, C = (2, 16) if bits in (4, 8) else (4, 8)
    _encode_kernel[(n, heads, dim // 32)](rows, pages, slots, books(rows.device), rows.stride(0), heads, dim, pages.shape[3],
                                          CODEC=number, BITS=bits, SIZE=size, R=R, C=C)


CODED_APPENDS = [("u8", F, INT, *r) for r in ROPE_INPUTS]


@jet("kv_append", CUDA, [(*keys, *values) for keys in CODED_APPENDS for values in (("none", "none"), keys[:2])],
     struct={"codec": ON_DEVICE})
@device_jet
def kv_append(pages, new, slots, positions=None, inv_freq=None, v_pages=None, v_new=None, style="neox", codec="none"):
    """Rows of `new` (rotated first, given rope's inputs) encoded into their slots of a compressed cache, in
    place; values into theirs if given."""
    if positions is not None:
        new = rope(new, positions, inv_freq, style=style)
    encode_into(codec, pages, new.reshape(-1, *new.shape[-2:]), slots.reshape(-1).contiguous())
    if v_pages is None:
        return pages
    return pages, kv_append(v_pages, v_new, slots, codec=codec)



@chained
@triton.jit
def _kv_read_kernel(words_ptr, slots_ptr, out_ptr, curves_ptr, rows, heads, cached, row_words, blocks, dim,
                    CODEC: tl.constexpr, BITS: tl.constexpr, SIZE: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr):
    """BT of the (slot, head) rows read, (i, h) for slots[i] (negative: from the end of the cached slots):
    their bytes decoded to f32 [BT, dim]."""
    after_prior()
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = r < rows * heads
    slot = tl.load(slots_ptr + r // heads, mask=ok, other=0).to(tl.int64)
    slot = tl.where(slot < 0, slot + cached, slot)
    values = decoded(words_ptr, slot * heads + r % heads, ok, row_words, blocks, curves_ptr, CODEC, BITS, SIZE, NB)
    cols = tl.arange(0, NB * 32)
    tl.store(out_ptr + r[:, None].to(tl.int64) * dim + cols[None, :], values, mask=ok[:, None] & (cols < dim)[None, :])


KV_READ_ROWS = 16                       # (slot, head) rows a program decodes


@jet("kv_read", CUDA, [(F, INT)], struct={"codec": ("none",)})
@jet("kv_read", CUDA, [("u8", INT)], struct={"codec": ON_DEVICE})
@device_jet
def kv_read(pages, slots, codec="none"):
    """The cached head vectors at `slots` [..., H, D]: a float cache's rows as they are (the take jet's
    read), a compressed cache's decoded to f32 as the attention kernel decodes them."""
    P, block, heads, width = pages.shape
    if codec == "none":
        flat = slots.reshape(-1).to(torch.int64)
        flat = torch.where(flat < 0, flat + P * block, flat)
        return pages.reshape(P * block, heads, width).index_select(0, flat).reshape(*slots.shape, heads, width)
    number, bits, size = codec_constants(codec)
    blocks = width // size
    out = torch.empty((*slots.shape, heads, blocks * 32), dtype=torch.float32, device=pages.device)
    if out.numel():
        n = slots.numel()
        _kv_read_kernel[(triton.cdiv(n * heads, KV_READ_ROWS),)](
            words(pages, codec), slots.reshape(-1).contiguous(), out, curves(pages.device), n, heads, P * block, width // 2,
            blocks, blocks * 32, CODEC=number, BITS=bits, SIZE=size, NB=triton.next_power_of_2(blocks), BT=KV_READ_ROWS)
    return out

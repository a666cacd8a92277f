"""Rotary position embedding: the rope jet, the rotation other kernels apply to values they have loaded
(`rotated`, or `turned_pairs` in registers: attention's queries), and the KV-cache write, which rotates
keys as it stores them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import CUDA, INT, F, device_jet, strided_rows
from soma_runtime.ir.jets import jet


@triton.jit
def turns(d, position, freq_ptr, half, NEOX: tl.constexpr):
    """cos and sin of the angles dims `d` turn by at `position` (0 past the 2 * half rotary dims). They
    depend on the step's inputs and constants only: kernels work them out before PDL's wait."""
    f = d % half if NEOX else d // 2
    angle = position * tl.load(freq_ptr + f, mask=d < 2 * half, other=0.0)       # by dim only: shared by a tile's rows
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def rotated(row_ptr, d, value, keep, cos, sin, half, NEOX: tl.constexpr):
    """Rope on values already loaded from one head's row (`d`: their dims; cos and sin from `turns`):
    each rotary dim meets its pair partner (i + half under neox, else the neighbour), loaded here; dims
    past 2 * half pass."""
    rotary = d < 2 * half
    if NEOX:
        first = d < half
        partner = tl.where(first, d + half, d - half)
    else:
        first = d % 2 == 0
        partner = d ^ 1
    other = tl.load(row_ptr + partner, mask=keep & rotary, other=0.0).to(tl.float32)
    turned = value * cos + tl.where(first, -other, other) * sin
    return tl.where(keep & rotary, turned, value)


@triton.jit
def turned_pairs(value, cos, sin):
    """Interleaved rope on a loaded [rows, dims] tile, in registers (a pair's dims are neighbours): cos
    and sin [1, dims / 2] by pair, from `turns` of each pair's first dim (past the rotary dims: by 0).
    Neox pairs, half a row apart, are faster loading their partners (`rotated`)."""
    even, odd = tl.split(tl.reshape(value, (value.shape[0], value.shape[1] // 2, 2)))
    return tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), value.shape)


@chained
@triton.jit
def _rope_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, heads, dim, half, NEOX: tl.constexpr, BLOCK: tl.constexpr):
    """One (position, head) row of x [rows, heads, dim], rotated (see `rotated`)."""
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    keep = d < dim
    cos, sin = turns(d, tl.load(pos_ptr + row // heads).to(tl.float32), freq_ptr, half, NEOX)
    after_prior()
    value = tl.load(x_ptr + row * dim + d, mask=keep, other=0.0).to(tl.float32)
    turned = rotated(x_ptr + row * dim, d, value, keep, cos, sin, half, NEOX)
    tl.store(out_ptr + row * dim + d, turned.to(out_ptr.dtype.element_ty), mask=keep)


@jet("rope", CUDA, [(F, INT, "f32")])
@device_jet
def rope(x, positions, inv_freq, style="neox"):
    x = x.contiguous()
    heads, dim = x.shape[-2], x.shape[-1]
    positions = positions.expand(x.shape[:-2]).contiguous()
    out = torch.empty_like(x)
    half = inv_freq.shape[0]
    _rope_kernel[(x.numel() // dim,)](x, positions, inv_freq.contiguous(), out, heads, dim, half, NEOX=style == "neox",
                                      BLOCK=triton.next_power_of_2(dim))
    return out


@triton.jit
def _append_rows(pages_ptr, new_ptr, r, stride, i, slot, cos, sin, width, dim, half, ROPE: tl.constexpr, NEOX: tl.constexpr):
    """Columns i of row r of `new` (rows `stride` apart) into its cache slot (rotated first with ROPE: a key)."""
    keep = i < width
    value = tl.load(new_ptr + r * stride + i, mask=keep).to(tl.float32)
    if ROPE:
        value = rotated(new_ptr + r * stride + (i - i % dim), i % dim, value, keep, cos, sin, half, NEOX)
    tl.store(pages_ptr + slot * width + i, value.to(pages_ptr.dtype.element_ty), mask=keep)


@chained
@triton.jit
def _kv_append_kernel(pages_ptr, new_ptr, v_pages_ptr, v_new_ptr, slots_ptr, pos_ptr, freq_ptr, new_stride, v_stride, width, dim,
                      half, ROPE: tl.constexpr, NEOX: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, part, which): columns part*BLOCK.. of row r, of the keys (which 0) or the values (1)."""
    r, part = tl.program_id(0), tl.program_id(1)
    i = part * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    cos, sin = 1.0, 0.0
    if ROPE:
        cos, sin = turns(i % dim, tl.load(pos_ptr + r).to(tl.float32), freq_ptr, half, NEOX)
    after_prior()
    if tl.program_id(2) == 0:
        _append_rows(pages_ptr, new_ptr, r, new_stride, i, slot, cos, sin, width, dim, half, ROPE, NEOX)
    else:
        _append_rows(v_pages_ptr, v_new_ptr, r, v_stride, i, slot, cos, sin, width, dim, half, False, NEOX)


ROPE_INPUTS = ((INT, "f32"), ("none", "none"))      # an op's fused rope: positions and inv_freq, or neither
KV_APPENDS = [(F, F, INT, *r) for r in ROPE_INPUTS] + [(c, "f32", INT, *r) for c in ("f16", "bf16") for r in ROPE_INPUTS]


@jet("kv_append", CUDA, [(*keys, *values) for keys in KV_APPENDS for values in (("none", "none"), keys[:2])],
     struct={"codec": ("none",)})
@device_jet
def kv_append(pages, new, slots, positions=None, inv_freq=None, v_pages=None, v_new=None, style="neox", codec="none"):
    """Rows of `new` into their cache slots, in place (rotated first, given rope's inputs), and the
    values' rows into theirs in the same launch if given; the caches themselves are the result."""
    width = pages.shape[2] * pages.shape[3]
    flat_slots = slots.reshape(-1).contiguous()
    rows = strided_rows(new, width)
    values = rows if v_new is None else strided_rows(v_new, width)
    rope = positions is not None
    _kv_append_kernel[(rows.shape[0], triton.cdiv(width, 256), 1 if v_pages is None else 2)](
        pages, rows, pages if v_pages is None else v_pages, values, flat_slots,
        positions.expand(new.shape[:-2]).contiguous() if rope else flat_slots, inv_freq.contiguous() if rope else rows,
        rows.stride(0), values.stride(0), width, pages.shape[3], inv_freq.shape[0] if rope else 0, ROPE=rope,
        NEOX=style == "neox", BLOCK=256)
    return pages if v_pages is None else (pages, v_pages)

"""GGUF blocks decoded on the device, 32 weights (one block, or one sub-block of a 256-weight K-quant
block) at a time, from rows as device.py stores them (the 32-weight formats and q6_K planar, q4_K
and q5_K as GGUF writes them); and the embedding jet, whose quantized tables decode that way."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import CUDA, INT, DeviceQTensor, F, device_jet
from soma_runtime.ir.jets import jet
from soma_runtime.quant import formats

# the GGUF type ids kernels branch on, as constants the JIT reads
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = (tl.constexpr(formats.Q4_0), tl.constexpr(formats.Q4_1), tl.constexpr(formats.Q8_0),
                                      tl.constexpr(formats.Q4_K), tl.constexpr(formats.Q5_K), tl.constexpr(formats.Q6_K))
QUANTIZED = ("q4_0", "q4_1", "q8_0", "q4_K", "q5_K", "q6_K")       # the formats the device decodes


@triton.jit
def f16_at(ptr):
    """The f16 stored at byte pointers `ptr`, as f32: one 2-byte load (every scale and min is 2-byte
    aligned: the formats' blocks and rows have even sizes, planar rows are 16-byte padded)."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def scale_min(b0, b1, b2, sub):
    """Sub-block `sub`'s 6-bit scale and min (as f32) in a q4_K / q5_K superblock, from bytes u, 4 + u and
    8 + u of its 12 scale bytes, u = sub % 4 (ggml's get_scale_min_k4)."""
    scale = tl.where(sub < 4, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    low = tl.where(sub < 4, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return scale.to(tl.float32), low.to(tl.float32)


@triton.jit
def decode_int8(rows, b, blocks, FMT: tl.constexpr):
    """Block b of each row (`rows`: byte pointers to row starts; rows and b broadcast to a shape S; the
    32-weight formats planar, q4_K as GGUF stores it) -> (q [S..., 32] int8, scale [S...], min [S...]):
    a weight is scale * q (+ min for q4_1 and q4_K)."""
    j = tl.arange(0, 32)
    if FMT == Q4_K or FMT == Q5_K:                              # q4_K: d, dmin, 12 bytes of 6-bit scales/mins, 128 qs
        base = rows + (b // 8) * (144 if FMT == Q4_K else 176)   # q5_K: 32 bytes of high bits before the qs
        sub = b % 8
        sc, mn = scale_min(tl.load(base + 4 + sub % 4), tl.load(base + 8 + sub % 4), tl.load(base + 12 + sub % 4), sub)
        byte = tl.load(tl.expand_dims(base + (16 if FMT == Q4_K else 48) + (sub // 2) * 32, -1) + j)
        q = (byte >> tl.expand_dims((sub % 2) * 4, -1)) & 15
        if FMT == Q5_K:                                       # bit `sub` of high byte j: weight j's fifth bit
            q |= ((tl.load(tl.expand_dims(base + 16, -1) + j) >> tl.expand_dims(sub, -1)) & 1) << 4
        return q.to(tl.int8), f16_at(base) * sc, -(f16_at(base + 2) * mn)
    quant_bytes: tl.constexpr = 32 if FMT == Q8_0 else 16
    scales = rows + blocks * quant_bytes + 2 * b
    d = f16_at(scales)
    if FMT == Q8_0:                                            # q8_0: 32 x int8
        q = tl.load(tl.expand_dims(rows + b * 32, -1) + j).to(tl.int8, bitcast=True)
        return q, d, d * 0.0
    byte = tl.load(tl.expand_dims(rows + b * 16, -1) + j % 16)
    q = ((byte >> ((j // 16) * 4)) & 15).to(tl.int8)        # low nibbles hold weights 0..15
    if FMT == Q4_0:                                            # q4_0: q - 8
        return q - 8, d, d * 0.0
    return q, d, f16_at(scales + 2 * blocks)               # q4_1: a min after the scales


@triton.jit
def q6k_int8(rows, b, blocks):
    """Block b of planar q6_K rows (planes of 128 ql, 64 qh, 16 int8 scales, d per superblock; shapes as
    `decode_int8`) -> (q - 32 [S..., 32] int8, the scale of weights 0..15, of 16..31 [S...])."""
    j = tl.arange(0, 32)
    superblock, sub, superblocks = b // 8, b % 8, blocks // 8
    half, quarter = sub // 4, sub % 4
    low = tl.load(tl.expand_dims(rows + superblock * 128 + 64 * half + 32 * (quarter % 2), -1) + j)
    high = tl.load(tl.expand_dims(rows + superblocks * 128 + superblock * 64 + 32 * half, -1) + j)
    q = ((low >> tl.expand_dims(4 * (quarter // 2), -1)) & 15) | (((high >> tl.expand_dims(2 * quarter, -1)) & 3) << 4)
    scales = (rows + superblocks * 192 + superblock * 16 + 8 * half + 2 * quarter).to(tl.pointer_type(tl.int8))
    d = f16_at(rows + superblocks * 208 + superblock * 2)
    return (q.to(tl.int8) - 32, d * tl.load(scales).to(tl.float32), d * tl.load(scales + 1).to(tl.float32))


@triton.jit
def decode_f32(rows, b, blocks, FMT: tl.constexpr):
    """Weights b*32 .. b*32+31 of each row, decoded to f32 [S..., 32] (shapes as `decode_int8`)."""
    if FMT == Q6_K:
        q, first, second = q6k_int8(rows, b, blocks)
        return tl.where(tl.arange(0, 32) < 16, tl.expand_dims(first, -1), tl.expand_dims(second, -1)) * q.to(tl.float32)
    q, d, m = decode_int8(rows, b, blocks, FMT)
    return tl.expand_dims(d, -1) * q.to(tl.float32) + tl.expand_dims(m, -1)


@chained
@triton.jit
def _embedding_kernel(table_ptr, ids_ptr, out_ptr, dim, row_bytes, FMT: tl.constexpr, DENSE: tl.constexpr):
    """Row ids[r], 32 columns per program: dense tables copy, quantized ones decode."""
    after_prior()
    r, b = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, 32)
    row = tl.load(ids_ptr + r).to(tl.int64)
    if DENSE:
        keep = b * 32 + j < dim
        value = tl.load(table_ptr + row * dim + b * 32 + j, mask=keep)
        tl.store(out_ptr + r * dim + b * 32 + j, value.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        rows_ptr = table_ptr + row * row_bytes + tl.zeros((1,), tl.int64)
        value = tl.reshape(decode_f32(rows_ptr, b, dim // 32, FMT), (32,))
        tl.store(out_ptr + r * dim + b * 32 + j, value)


@jet("embedding", CUDA, [(F, INT)] + [(q, INT) for q in QUANTIZED])
@device_jet
def embedding(table, ids):
    flat = ids.reshape(-1).contiguous()
    dim = table.shape[-1]
    dense = not isinstance(table, DeviceQTensor)
    out = torch.empty((flat.numel(), dim), dtype=table.dtype if dense else torch.float32, device=flat.device)
    data = table.contiguous() if dense else table.data
    _embedding_kernel[(flat.numel(), triton.cdiv(dim, 32))](data, flat, out, dim, 0 if dense else data.shape[1],
                                                             FMT=0 if dense else table.dtype.ggml_id, DENSE=dense)
    return out.reshape(*ids.shape, dim)

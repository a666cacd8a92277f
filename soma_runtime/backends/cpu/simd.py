"""LLVM vector IR for integer block dot products, emitted into numba kernels through intrinsics.

numba types integer arithmetic as int64, which keeps byte-sized math out of SIMD lanes. Here each
32-weight block is decoded into a <32 x u8> vector and dotted with 32 int8 activations in groups
of 4 bytes into <8 x i32>: one `vpdpbusd` where the CPU has VNNI, portable vector IR elsewhere
(LLVM picks the instructions). Both give the same exact integers, so every path agrees bit for bit.

Weights are unsigned here; a signed format stores w + bias, and the bias comes off through the
accumulator's start value, -bias * (sum of each 4-byte activation group), precomputed per block.
"""
from __future__ import annotations

from dataclasses import dataclass

import llvmlite.binding
import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from soma_runtime.quant.formats import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

I8, I32, F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
# weights stream once per token: asking for them this far ahead (every other block: about one cache
# line) takes a 2-core decode read from ~10 to ~13 GB/s
PREFETCH_BYTES = 2048


def i32(value):
    return ir.Constant(I32, value)


def vec(t, n):
    return ir.VectorType(t, n)


def const_vec(elem, values):
    return ir.Constant(vec(elem, len(values)), [ir.Constant(elem, v) for v in values])


@dataclass(frozen=True)
class BlockLayout:
    """Where the parts of one 32-weight block sit, in bytes; `bias` is what the stored value exceeds the weight by."""
    size: int
    scale: int
    quants: int
    min: int | None = None        # offset of the f16 min (formats that add m * sum of activations)
    high_bits: int | None = None  # offset of the 32-bit word of 5th bits
    bias: int = 0
    bits: int = 4


LAYOUTS = {
    Q4_0: BlockLayout(18, scale=0, quants=2, bias=8),
    Q4_1: BlockLayout(20, scale=0, min=2, quants=4),
    Q5_0: BlockLayout(22, scale=0, high_bits=2, quants=6, bias=16),
    Q5_1: BlockLayout(24, scale=0, min=2, high_bits=4, quants=8),
    Q8_0: BlockLayout(34, scale=0, quants=2, bias=128, bits=8),
}


def host_vnni() -> str | None:
    """The VNNI intrinsic this CPU runs, if numba compiles for the host (NUMBA_CPU_NAME unset)."""
    if numba.config.CPU_NAME:
        return None
    features = llvmlite.binding.get_host_cpu_features()
    if features.get("avx512vnni") and features.get("avx512vl"):
        return "llvm.x86.avx512.vpdpbusd.256"
    if features.get("avxvnni"):
        return "llvm.x86.avxvnni.vpdpbusd.256"
    return None


def load(builder, base, offset, ty):
    ptr = builder.gep(base, [offset]) if offset is not None else base
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)


def load_f16(builder, base, offset):
    return builder.fpext(load(builder, base, i32(offset), ir.HalfType()), F32)


def decode_block(builder, block, layout: BlockLayout):
    """(weights as <32 x u8> stored values, scale, min or None) of the block at byte pointer `block`."""
    if layout.bits == 8:                             # int8 weights; flipping the sign bit adds 128
        raw = load(builder, block, i32(layout.quants), vec(I8, 32))
        weights = builder.xor(raw, const_vec(I8, [0x80] * 32))
    else:
        raw = load(builder, block, i32(layout.quants), vec(I8, 16))
        low = builder.and_(raw, const_vec(I8, [15] * 16))
        high = builder.lshr(raw, const_vec(I8, [4] * 16))
        weights = builder.shuffle_vector(low, high, const_vec(I32, list(range(32))))
        if layout.high_bits is not None:             # bit j of the word is weight j's 5th bit
            word = load(builder, block, i32(layout.high_bits), I32)
            spread = builder.shuffle_vector(builder.insert_element(ir.Constant(vec(I32, 32), None), word, i32(0)),
                                            ir.Constant(vec(I32, 32), None), const_vec(I32, [0] * 32))
            bit = builder.and_(builder.lshr(spread, const_vec(I32, list(range(32)))), const_vec(I32, [1] * 32))
            weights = builder.or_(weights, builder.shl(builder.trunc(bit, vec(I8, 32)), const_vec(I8, [4] * 32)))
    scale = load_f16(builder, block, layout.scale)
    minimum = load_f16(builder, block, layout.min) if layout.min is not None else None
    return weights, scale, minimum


def dot_groups(builder, weights, quants, acc, vnni: str | None):
    """acc[i] + sum over j<4 of weights[4i+j] (unsigned) * quants[4i+j] (signed), as <8 x i32>."""
    if vnni:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec(I32, 8), [vec(I32, 8), vec(I8, 32), vec(I8, 32)]), vnni)
        return builder.call(fn, [acc, weights, quants])
    products = builder.mul(builder.zext(weights, vec(I32, 32)), builder.sext(quants, vec(I32, 32)))
    for j in range(4):
        acc = builder.add(acc, builder.shuffle_vector(products, products, const_vec(I32, [4 * i + j for i in range(8)])))
    return acc


def prefetch(builder, ptr):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [ptr, i32(0), i32(3), i32(1)])      # read, keep in all cache levels, data


def splat(builder, value, n=8):
    one = builder.insert_element(ir.Constant(vec(value.type, n), None), value, i32(0))
    return builder.shuffle_vector(one, one, const_vec(I32, [0] * n))


def hsum(builder, v):
    """Sum of 8 floats in ggml's order (halves, then pairs), so reductions match its x86 kernels."""
    half = builder.fadd(builder.shuffle_vector(v, v, const_vec(I32, [0, 1, 2, 3])),
                        builder.shuffle_vector(v, v, const_vec(I32, [4, 5, 6, 7])))
    pair = builder.fadd(builder.shuffle_vector(half, half, const_vec(I32, [0, 1])),
                        builder.shuffle_vector(half, half, const_vec(I32, [2, 3])))
    return builder.fadd(builder.extract_element(pair, i32(0)), builder.extract_element(pair, i32(1)))


@intrinsic
def row_dots(typingctx, fmt, rows, portable, w, qs, d, s, gs, m0, n, out):
    """out[m0 + r, n] = weight row n . activation row m0 + r for r < `rows`, each weight block decoded
    once for all those rows. `fmt` (a GGML type id), `rows` and `portable` (1: no VNNI) must be
    compile-time constants. Activations are q8 blocks: qs [M, K] int8, scales d [M, K/32],
    s = d * block sum [M, K/32], 4-byte group sums gs [M, K/4]; weights w [N, row bytes]."""
    if not all(isinstance(t, types.IntegerLiteral) for t in (fmt, rows, portable)):
        return None
    layout, n_rows = LAYOUTS[fmt.literal_value], rows.literal_value
    vnni = None if portable.literal_value else host_vnni()
    sig = types.void(fmt, rows, portable, w, qs, d, s, gs, types.intp, types.intp, out)

    def codegen(context, builder, signature, args):
        w, qs, d, s, gs, out = (context.make_array(t)(context, builder, v)
                                for t, v in zip(signature.args[3:8] + signature.args[10:], args[3:8] + args[10:]))
        m0, n = args[8], args[9]
        intp = m0.type
        k = builder.extract_value(qs.shape, 1)
        blocks = builder.udiv(k, ir.Constant(intp, 32))
        n_out = builder.extract_value(out.shape, 1)
        row = builder.gep(w.data, [builder.mul(n, builder.extract_value(w.shape, 1))])
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vec(F32, 8), [ir.Constant(F32, 0.0)] * 8)) for _ in range(n_rows)]
        mins = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(n_rows)]
        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            block = builder.gep(row, [builder.mul(b, ir.Constant(intp, layout.size))])
            with builder.if_then(builder.icmp_unsigned("==", builder.and_(b, ir.Constant(intp, 1)), ir.Constant(intp, 0))):
                prefetch(builder, builder.gep(block, [ir.Constant(intp, PREFETCH_BYTES)]))
            weights, scale, minimum = decode_block(builder, block, layout)
            for r in range(n_rows):
                m = builder.add(m0, ir.Constant(intp, r))
                at = builder.add(builder.mul(m, blocks), b)            # index of (m, b) in d, s
                quants = load(builder, qs.data, builder.add(builder.mul(m, k), builder.mul(b, ir.Constant(intp, 32))), vec(I8, 32))
                start = ir.Constant(vec(I32, 8), [i32(0)] * 8)
                if layout.bias:
                    groups = load(builder, gs.data, builder.mul(at, ir.Constant(intp, 8)), vec(I32, 8))
                    start = builder.sub(start, builder.mul(groups, const_vec(I32, [layout.bias] * 8)))
                total = dot_groups(builder, weights, quants, start, vnni)
                block_scale = builder.fmul(scale, builder.load(builder.gep(d.data, [at])))
                term = builder.fmul(builder.sitofp(total, vec(F32, 8)), splat(builder, block_scale))
                builder.store(builder.fadd(builder.load(accs[r]), term), accs[r])
                if minimum is not None:
                    term = builder.fmul(minimum, builder.load(builder.gep(s.data, [at])))
                    builder.store(builder.fadd(builder.load(mins[r]), term), mins[r])
        for r in range(n_rows):
            value = builder.fadd(hsum(builder, builder.load(accs[r])), builder.load(mins[r]))
            m = builder.add(m0, ir.Constant(intp, r))
            builder.store(value, builder.gep(out.data, [builder.add(builder.mul(m, n_out), n)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def widen(typingctx, x):
    """A cache element as f32: f16 bits (uint16, numba has no float16) convert, f32 passes through."""
    def codegen(context, builder, signature, args):
        if signature.args[0] == types.uint16:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), F32)
        return args[0]
    return types.float32(x), codegen


@intrinsic
def narrow(typingctx, x, like):
    """x (f32) rounded to the precision of `like`'s type: f16 bits (uint16) round to nearest even."""
    def codegen(context, builder, signature, args):
        if signature.args[1] == types.uint16:
            return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), F32)
        return args[0]
    return types.float32(x, like), codegen

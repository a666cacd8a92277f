"""LLVM vector IR for integer block dot products, emitted into numba kernels through intrinsics.

numba types integer arithmetic as int64, which keeps byte-sized math out of SIMD lanes. Here each
32-weight block is decoded once into a byte vector and dotted with 32 int8 activations in groups
of 4 bytes into <8 x i32>: one `vpdpbusd` (unsigned x signed bytes) where the CPU has VNNI,
portable vector IR elsewhere (LLVM picks the instructions). Both give the same exact integers.

The weights are always the unsigned operand: q4_1 and q5_1 store them unsigned; q4_0 and q5_0 store
weight + 8 (or 16); q8_0's signed bytes become weight + 128 by flipping their sign bits. Where a
weight is its unsigned value minus such a bias, the bias comes off through the accumulator's start,
-bias * (sum of each 4 activations), summed once per activation row when it is quantized and shared
by every weight row.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from soma_runtime.quant.formats import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

# numba's disk cache keys a kernel on its own module; kernels built on this IR carry this stamp in
# their closure so that a change here recompiles them
SOURCE_STAMP = zlib.crc32(Path(__file__).read_bytes())
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
    bias: int = 0                 # unsigned value - weight (formats without a min): a power of two
    bits: int = 4


LAYOUTS = {
    Q4_0: BlockLayout(18, scale=0, quants=2, bias=8),
    Q4_1: BlockLayout(20, scale=0, min=2, quants=4),
    Q5_0: BlockLayout(22, scale=0, high_bits=2, quants=6, bias=16),
    Q5_1: BlockLayout(24, scale=0, min=2, high_bits=4, quants=8),
    Q8_0: BlockLayout(34, scale=0, quants=2, bits=8, bias=128),
}


def host_vnni() -> str | None:
    """The VNNI this CPU runs ("avx512" or "avx"), if numba compiles for the host (NUMBA_CPU_NAME unset)."""
    if numba.config.CPU_NAME:
        return None
    features = llvmlite.binding.get_host_cpu_features()
    if features.get("avx512vnni") and features.get("avx512vl"):
        return "avx512"
    return "avx" if features.get("avxvnni") else None


def load(builder, base, offset, ty):
    ptr = builder.gep(base, [offset]) if offset is not None else base
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)


def load_f16(builder, base, offset):
    return builder.fpext(load(builder, base, i32(offset), ir.HalfType()), F32)


def decode_block(builder, block, layout: BlockLayout):
    """(unsigned weights <32 x i8>, scale, min or None) of the block at byte pointer `block`."""
    if layout.bits == 8:                              # flipping the sign bit adds 128
        weights = builder.xor(load(builder, block, i32(layout.quants), vec(I8, 32)), const_vec(I8, [0x80] * 32))
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


def zeros(ty):
    return ir.Constant(ty, None)


def dot_groups(builder, unsigned, signed, acc, vnni: str | None):
    """acc[i] + sum over j<4 of unsigned[4i+j] * signed[4i+j], for 32 or 64 bytes into 8 or 16 i32 lanes."""
    lanes = acc.type.count
    if vnni == "avx512" or (vnni == "avx" and lanes == 8):
        name = f"llvm.x86.avx512.vpdpbusd.{lanes * 32}" if vnni == "avx512" else "llvm.x86.avxvnni.vpdpbusd.256"
        signature = ir.FunctionType(acc.type, [acc.type, unsigned.type, signed.type])
        fn = cgutils.get_or_insert_function(builder.module, signature, name)
        return builder.call(fn, [acc, unsigned, signed])
    if vnni == "avx":                                 # 256-bit VNNI only: two halves
        halves = [dot_groups(builder, *(builder.shuffle_vector(v, v, const_vec(I32, list(range(h * n, h * n + n))))
                                        for v, n in ((unsigned, 32), (signed, 32), (acc, 8))), vnni) for h in (0, 1)]
        return builder.shuffle_vector(halves[0], halves[1], const_vec(I32, list(range(16))))
    wide = vec(I32, 4 * lanes)
    products = builder.mul(builder.zext(unsigned, wide), builder.sext(signed, wide))
    for j in range(4):
        acc = builder.add(acc, builder.shuffle_vector(products, products, const_vec(I32, [4 * i + j for i in range(lanes)])))
    return acc


def concat(builder, a, b):
    return builder.shuffle_vector(a, b, const_vec(I32, list(range(2 * a.type.count))))


def fmuladd(builder, a, b, c):
    """a * b + c, fused where the CPU has FMA (as ggml's x86 kernels accumulate)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), f"llvm.fmuladd.v{a.type.count}f32")
    return builder.call(fn, [a, b, c])


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
def row_dots(typingctx, fmt, rows, portable, w, qs, d, s, groups, m0, n, out):
    """out[m0 + r, n] = weight row n . activation row m0 + r for r < `rows`, each weight block decoded
    once for all those rows. `fmt` (a GGML type id), `rows` and `portable` (1: no VNNI) must be
    compile-time constants. Activations are q8 blocks: qs [M, K] int8, scales d [M, K/32],
    s = d * block sum [K/32, M] (for formats with a min) and the sums of each 4, groups [M, K/4]
    (for formats with a bias); weights w [N, row bytes].
    Blocks go two at a time through the integer dot (64 bytes), then one at a time into 8 float
    lanes per row, in ggml's order."""
    if not all(isinstance(t, types.IntegerLiteral) for t in (fmt, rows, portable)):
        return None
    layout, n_rows = LAYOUTS[fmt.literal_value], rows.literal_value
    vnni = None if portable.literal_value else host_vnni()
    sig = types.void(fmt, rows, portable, w, qs, d, s, groups, types.intp, types.intp, out)

    def codegen(context, builder, signature, args):
        w, qs, d, s, groups, out = (context.make_array(t)(context, builder, v)
                                    for t, v in zip(signature.args[3:8] + signature.args[10:], args[3:8] + args[10:]))
        m0, n = args[8], args[9]
        intp = m0.type
        const = lambda v: ir.Constant(intp, v)
        k, m_rows = builder.extract_value(qs.shape, 1), builder.extract_value(qs.shape, 0)
        blocks = builder.udiv(k, const(32))
        row = builder.gep(w.data, [builder.mul(n, builder.extract_value(w.shape, 1))])
        accs = [cgutils.alloca_once_value(builder, zeros(vec(F32, 8))) for _ in range(n_rows)]
        mins = cgutils.alloca_once_value(builder, zeros(vec(F32, n_rows)))     # one lane per activation row

        def step(b, count):
            """Blocks b .. b + count - 1 (count 1 or 2) into every row's accumulator."""
            decoded = [decode_block(builder, builder.gep(row, [builder.mul(builder.add(b, const(i)), const(layout.size))]),
                                    layout) for i in range(count)]
            weights = decoded[0][0] if count == 1 else concat(builder, decoded[0][0], decoded[1][0])
            scales = [splat(builder, x[1]) for x in decoded]
            scales = scales[0] if count == 1 else concat(builder, *scales)
            for i, (_, _, minimum) in enumerate(decoded):
                if minimum is not None:        # s is stored [K/32, M]: the rows' sums of one block sit together
                    sums = load(builder, s.data, builder.add(builder.mul(builder.add(b, const(i)), m_rows), m0), vec(F32, n_rows))
                    builder.store(fmuladd(builder, splat(builder, minimum, n_rows), sums, builder.load(mins)), mins)
            for r in range(n_rows):
                m = builder.add(m0, const(r))
                quants = load(builder, qs.data, builder.add(builder.mul(m, k), builder.mul(b, const(32))), vec(I8, 32 * count))
                start = zeros(vec(I32, 8 * count))
                if layout.bias:                                        # -bias * (sum of each 4 activations)
                    at = builder.add(builder.mul(m, builder.udiv(k, const(4))), builder.mul(b, const(8)))
                    sums = load(builder, groups.data, at, vec(I32, 8 * count))
                    start = builder.sub(start, builder.shl(sums, const_vec(I32, [layout.bias.bit_length() - 1] * 8 * count)))
                total = dot_groups(builder, weights, quants, start, vnni)
                act = load(builder, d.data, builder.add(builder.mul(m, blocks), b), vec(F32, count))
                spread = const_vec(I32, [i for i in range(count) for _ in range(8)])
                act = builder.fmul(scales, builder.shuffle_vector(act, act, spread))
                term = builder.sitofp(total, vec(F32, 8 * count))
                acc = builder.load(accs[r])
                for i in range(count):         # block by block into 8 lanes: ggml's order of float sums
                    lanes = const_vec(I32, list(range(8 * i, 8 * i + 8)))
                    terms, acts = builder.shuffle_vector(term, term, lanes), builder.shuffle_vector(act, act, lanes)
                    acc = fmuladd(builder, terms, acts, acc)
                builder.store(acc, accs[r])

        pairs = builder.udiv(blocks, const(2))
        with cgutils.for_range(builder, pairs) as loop:
            b = builder.mul(loop.index, const(2))
            prefetch(builder, builder.gep(row, [builder.add(builder.mul(b, const(layout.size)), const(PREFETCH_BYTES))]))
            step(b, 2)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(blocks, const(1)), const(0))):
            step(builder.sub(blocks, const(1)), 1)
        n_out = builder.extract_value(out.shape, 1)
        for r in range(n_rows):
            value = builder.fadd(hsum(builder, builder.load(accs[r])), builder.extract_element(builder.load(mins), i32(r)))
            builder.store(value, builder.gep(out.data, [builder.add(builder.mul(builder.add(m0, const(r)), n_out), n)]))
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


@intrinsic
def stored(typingctx, x, like):
    """x (f32) as an element of `like`'s array: f16 bits (uint16, rounded to nearest even) or f32."""
    def codegen(context, builder, signature, args):
        if signature.args[1] == types.uint16:
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return args[0]
    return (types.uint16 if like == types.uint16 else types.float32)(x, like), codegen


@intrinsic
def widen_bits(typingctx, x, bf16):
    """16-bit float bits (uint16) as f32: f16 when the literal `bf16` is 0, else bf16 (the high half
    of an f32's bit pattern)."""
    if not isinstance(bf16, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        if signature.args[1].literal_value:
            return builder.bitcast(builder.shl(builder.zext(args[0], I32), i32(16)), F32)
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), F32)
    return types.float32(types.uint16, bf16), codegen


@intrinsic
def power_of_two(typingctx, n):
    """2 ** n as f32 for an integral f32 n in [-126, 127], built from its exponent bits."""
    def codegen(context, builder, signature, args):
        exponent = builder.add(builder.fptosi(args[0], I32), i32(127))
        return builder.bitcast(builder.shl(exponent, i32(23)), F32)
    return types.float32(types.float32), codegen


@njit(inline="always", fastmath={"contract", "nsz"}, error_model="numpy")
def exp_f32(x):
    """e ** x in f32 within 2 ulp (Cephes' expf): plain arithmetic, so loops over it vectorize where
    a call to libm's expf would not. Below -87.3 (e.g. -inf, a masked score) it is exactly 0."""
    clamped = min(max(x, np.float32(-87.3)), np.float32(88.7))
    n = np.floor(clamped * np.float32(1.44269504) + np.float32(0.5))
    r = clamped - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    e = (p * r * r + r + np.float32(1)) * power_of_two(n)
    return e if x >= np.float32(-87.3) else np.float32(0)


@intrinsic
def prefetch_element(typingctx, array, index, ahead):
    """Ask for the cache line `ahead` bytes past array.flat[index] (a read that comes soon)."""
    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        base = builder.bitcast(builder.gep(arr.data, [args[1]]), I8.as_pointer())
        prefetch(builder, builder.gep(base, [args[2]]))
        return context.get_dummy_value()
    return types.void(array, types.intp, types.intp), codegen

"""bf16 matmul on the CPU's matrix units (Intel AMX), from numba through inline assembly.

A weight [N, K] of bf16 bits is read in place as AMX's A operand: 16 weight rows by 32 values
per tile. The activations, rounded to bf16 once per call, are packed as the B operand (pairs of
K interleaved per activation row, 16 rows per tile). Each program owns 32 weight rows: two weight
tiles times two activation tiles into four f32 accumulator tiles, over all of K, for every block
of 32 activation rows; the accumulators, [weight rows, activation rows], are written transposed. f32 accumulation, bf16 inputs:
the precision of torch's and llama.cpp's bf16 matmuls.

Linux hands out the tile registers on request (arch_prctl); `available()` asks once. Where the
CPU, the kernel or numba's target (NUMBA_CPU_NAME) rules AMX out, callers keep their f32 paths.
"""
from __future__ import annotations

import ctypes
import functools
import os
import weakref

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from soma_runtime.backends.cpu.elementwise import gelu_in_place
from soma_runtime.backends.cpu.simd import exp_f32
from soma_runtime.quant.formats import F16_TABLE, dequant_row

TILE = 16                     # rows per tile; a row is 64 bytes: 32 bf16 or 16 f32
EPILOGUES = ("none", "gelu", "gelu_tanh")      # matmul's epilogue attribute, by code
BLOCK = 2 * TILE              # rows of weights and of activations per program step (2 x 2 tiles)
ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158


@functools.cache
def available() -> bool:
    """AMX-BF16 present, numba compiling for this host, the kernel granting the tile state, and not
    turned off (SOMA_AMX=0)."""
    if numba.config.CPU_NAME or os.environ.get("SOMA_AMX") == "0":
        return False
    features = llvmlite.binding.get_host_cpu_features()
    if not (features.get("amx-tile") and features.get("amx-bf16")):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return True


# --- tile instructions as numba intrinsics (tile numbers are compile-time constants) -------------

llvmlite.binding.initialize_native_asmparser()         # numba's LLVM assembles inline asm only with it

def _asm(builder, template: str, constraints: str = "", args=()):
    builder.asm(ir.FunctionType(ir.VoidType(), [a.type for a in args]), template, constraints, list(args), side_effect=True)


def _address(context, builder, array_type, array, offset):
    """Byte address of element `offset` of a C-ordered array."""
    data = builder.ptrtoint(context.make_array(array_type)(context, builder, array).data, ir.IntType(64))
    size = context.get_abi_sizeof(context.get_data_type(array_type.dtype))
    return builder.add(data, builder.mul(offset, ir.Constant(ir.IntType(64), size)))


def _literals(*ts) -> bool:
    return all(isinstance(t, types.IntegerLiteral) for t in ts)


@intrinsic
def _configure(typingctx, config):
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        _asm(builder, "ldtilecfg ($0)", "r", [data])
        return context.get_dummy_value()
    return types.void(config), codegen


@intrinsic
def _release(typingctx):
    def codegen(context, builder, signature, args):
        _asm(builder, "tilerelease")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _zero(typingctx, tile):
    if not _literals(tile):
        return None
    template = f"tilezero %tmm{tile.literal_value}"

    def codegen(context, builder, signature, args):
        _asm(builder, template)
        return context.get_dummy_value()
    return types.void(tile), codegen


def _memory_op(template: str):
    """A tile load or store at element `offset` of an array, rows `stride` bytes apart."""
    @intrinsic
    def op(typingctx, tile, array, offset, stride):
        if not _literals(tile):
            return None
        text = template.format(tile=tile.literal_value)

        def codegen(context, builder, signature, args):
            address = _address(context, builder, signature.args[1], args[1], args[2])
            _asm(builder, text, "r,r", [address, args[3]])
            return context.get_dummy_value()
        return types.void(tile, array, types.int64, types.int64), codegen
    return op


_load = _memory_op("tileloadd ($0,$1,1), %tmm{tile}")
_store = _memory_op("tilestored %tmm{tile}, ($0,$1,1)")


@intrinsic
def _dot(typingctx, acc, a, b):
    """acc (f32 tile) += a (16 rows x 32 bf16) . b (16 pairs x 16 columns x 2 bf16)."""
    if not _literals(acc, a, b):
        return None
    template = f"tdpbf16ps %tmm{b.literal_value}, %tmm{a.literal_value}, %tmm{acc.literal_value}"

    def codegen(context, builder, signature, args):
        _asm(builder, template)
        return context.get_dummy_value()
    return types.void(acc, a, b), codegen


def _config() -> np.ndarray:
    """ldtilecfg's 64 bytes: palette 1, eight tiles of 16 rows by 64 bytes."""
    config = np.zeros(64, np.uint8)
    config[0] = 1
    config[16:32].view(np.uint16)[:] = 64
    config[48:56] = TILE
    return config


CONFIG = _config()


# --- kernels ----------------------------------------------------------------------------------

@njit(inline="always")
def _bf16(bits):
    """f32 bits -> bf16 bits, rounded to nearest even."""
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(cache=True)
def _pack_rows(x, packed, block):
    """Activation rows 16 block .. 16 block + 15 of x [M, K] (f32 bits, uint32) -> packed[block]:
    [K / 32, 16 pairs, 16 rows] words of two bf16 (the even k in the low half); rows past M are zero."""
    for r in range(TILE):
        m = block * TILE + r
        for kb in range(packed.shape[1]):
            for pair in range(TILE):
                word = np.uint32(0)
                if m < x.shape[0]:
                    i = kb * 32 + 2 * pair
                    word = (_bf16(x[m, i + 1]) << np.uint32(16)) | _bf16(x[m, i])
                packed[block, kb, pair, r] = word


@njit(inline="always")
def _dot_blocks(a, a0, k, b, b0, b1, k_blocks):
    """Accumulator tiles 0-3 (2 x 2) += 32 rows of `a` (bf16 bits [.., K] row-major, from element
    a0: A tiles 4, 5) times two columns of packed tiles (from words b0 and b1: B tiles 6, 7)."""
    tile_words = TILE * TILE
    for kb in range(k_blocks):
        _load(4, a, a0 + kb * 32, k * 2)
        _load(5, a, a0 + TILE * k + kb * 32, k * 2)
        _load(6, b, b0 + kb * tile_words, 64)
        _load(7, b, b1 + kb * tile_words, 64)
        _dot(0, 4, 6)
        _dot(1, 4, 7)
        _dot(2, 5, 6)
        _dot(3, 5, 7)


@njit(parallel=True, cache=True)
def _pack_activations(x, packed):
    for block in prange(packed.shape[0]):
        _pack_rows(x, packed, block)


@njit(parallel=True, cache=True, error_model="numpy")
def _gemm_rows(w, packed, bias, out, col0, config, epilogue):
    """out[:, col0 + j] = epilogue(x . w[j] + bias[col0 + j]) for the weight rows w [n, K] (bf16 bits,
    read in place: n a multiple of 32), x packed by _pack_rows. Accumulator tiles come out [weight
    rows, activation rows] and are written transposed."""
    n, k = w.shape
    rows = out.shape[0]
    m_blocks, k_blocks = packed.shape[0] // 2, k // 32
    tile_words = TILE * TILE                     # one packed tile: 16 pairs x 16 rows
    for nb in prange(n // BLOCK):
        _configure(config)                       # tile configuration is per thread
        acc = np.empty((4, TILE, TILE), np.float32)
        add = np.zeros(BLOCK, np.float32)
        n0 = nb * BLOCK
        if bias.size:
            add[:] = bias[col0 + n0: col0 + n0 + BLOCK]
        for mb in range(m_blocks):
            _zero(0)
            _zero(1)
            _zero(2)
            _zero(3)
            b0 = 2 * mb * k_blocks * tile_words
            _dot_blocks(w, n0 * k, k, packed, b0, b0 + k_blocks * tile_words, k_blocks)
            _store(0, acc, 0, 64)
            _store(1, acc, tile_words, 64)
            _store(2, acc, 2 * tile_words, 64)
            _store(3, acc, 3 * tile_words, 64)
            m0 = mb * BLOCK
            for t in range(4):                   # tile t: weight rows n0 + 16 (t // 2), activation rows m0 + 16 (t % 2)
                for i in range(TILE):
                    acc[t, i] += add[(t // 2) * TILE + i]
            if epilogue:
                gelu_in_place(acc.reshape(-1), epilogue == 2)
            for t in range(4):
                for j in range(TILE):
                    m = m0 + (t % 2) * TILE + j
                    if m < rows:
                        for i in range(TILE):
                            out[m, col0 + n0 + (t // 2) * TILE + i] = acc[t, i, j]
        _release()


@njit(parallel=True, cache=True)
def _pack_weight(w, packed):
    """w [N, K] bf16 bits -> packed [N / 16, K / 32, 16 pairs, 16 columns] words of two bf16 (the
    even k in the low half): AMX's B operand, one 1 KiB tile per (16 columns, 32 k)."""
    for nb in prange(packed.shape[0]):
        for kb in range(packed.shape[1]):
            for pair in range(TILE):
                for c in range(TILE):
                    row = w[nb * TILE + c]
                    i = kb * 32 + 2 * pair
                    packed[nb, kb, pair, c] = (np.uint32(row[i + 1]) << np.uint32(16)) | np.uint32(row[i])


@njit(parallel=True, cache=True)
def _to_bf16_rows(x, xb):
    """x [M, K] f32 bits -> xb [M_pad, K] bf16 bits, rows past M zero: the A operand as it lies."""
    rows, k = x.shape
    for m in prange(xb.shape[0]):
        for i in range(k):
            xb[m, i] = _bf16(x[m, i]) if m < rows else 0


@njit(parallel=True, cache=True, error_model="numpy")
def _gemm_packed(xb, rows, packed, bias, out, col0, config, threads, epilogue):
    """out[:rows, col0 + j] = epilogue(xb . w.T + bias[col0 + j]) for the weight rows in `packed`
    (by _pack_weight or _pack_quantized). Each accumulator tile is 16 activation rows by 16 outputs,
    stored straight into `out` (through a scratch tile for an epilogue or the last, partial rows).
    The bias (zeros for none) seeds the accumulators."""
    m_blocks, n_blocks, k_blocks = xb.shape[0] // BLOCK, packed.shape[0] // 2, packed.shape[1]
    tasks = m_blocks * n_blocks
    size = max(1, tasks // (4 * threads))
    for chunk in prange(-(-tasks // size)):       # tile state is set up once per chunk, not per task
        _configure(config)
        for task in range(chunk * size, min(tasks, (chunk + 1) * size)):
            _tile_task(task, n_blocks, k_blocks, rows, col0, packed, bias, xb, out, epilogue)
        _release()


@njit(inline="always")
def _tile_task(task, n_blocks, k_blocks, rows, col0, packed, bias, xb, out, epilogue):
    """One 32 x 32 block of out (m-major task order: a thread's activation rows stay in cache)."""
    tile_words = TILE * TILE
    n, k = out.shape[1], xb.shape[1]
    mb, nb = task // n_blocks, task % n_blocks
    m0, n0 = mb * BLOCK, col0 + nb * BLOCK
    _load(0, bias, n0, 0)                        # row stride 0: every row of the tile is the bias
    _load(1, bias, n0 + TILE, 0)
    _load(2, bias, n0, 0)
    _load(3, bias, n0 + TILE, 0)
    w0 = 2 * nb * k_blocks * tile_words           # this task's weight rows in `packed`
    _dot_blocks(xb, m0 * k, k, packed, w0, w0 + k_blocks * tile_words, k_blocks)
    if m0 + BLOCK <= rows and epilogue == 0:
        _store(0, out, m0 * n + n0, n * 4)
        _store(1, out, m0 * n + n0 + TILE, n * 4)
        _store(2, out, (m0 + TILE) * n + n0, n * 4)
        _store(3, out, (m0 + TILE) * n + n0 + TILE, n * 4)
    else:
        acc = np.empty((BLOCK, BLOCK), np.float32)
        _store(0, acc, 0, BLOCK * 4)
        _store(1, acc, TILE, BLOCK * 4)
        _store(2, acc, TILE * BLOCK, BLOCK * 4)
        _store(3, acc, TILE * BLOCK + TILE, BLOCK * 4)
        if epilogue:
            gelu_in_place(acc.reshape(-1), epilogue == 2)
        for r in range(min(BLOCK, rows - m0)):
            out[m0 + r, n0: n0 + BLOCK] = acc[r]


NO_BIAS = np.zeros(0, np.float32)
PACK_BUDGET = 512 << 20          # bytes of repacked weights kept; past it, weights are read in place
_packed: dict[int, tuple] = {}   # id(weight) -> (weak reference, packed copy)


def repacked(w: np.ndarray) -> np.ndarray | None:
    """The B-operand layout of bf16 weight w, made once and kept while w lives (None past the budget)."""
    entry = _packed.get(id(w))
    if entry is not None and entry[0]() is w:
        return entry[1]
    if sum(p.nbytes for _, p in _packed.values()) + w.nbytes > PACK_BUDGET:
        return None
    n, k = w.shape
    packed = np.empty((n // TILE, k // 32, TILE, TILE), np.uint32)
    _pack_weight(w.view(np.uint16), packed)
    key = id(w)
    _packed[key] = (weakref.ref(w, lambda _: _packed.pop(key, None)), packed)
    return packed


@njit(parallel=True, cache=True)
def _decode_bf16(data, fmt, lut, row0, tile):
    """Weight rows row0 .. row0 + len(tile) of a block format (rows of bytes, GGML type `fmt`)
    decoded and rounded to bf16 bits, row-major: the A operand as it lies."""
    for r in prange(tile.shape[0]):
        row = np.empty(tile.shape[1], np.float32)
        dequant_row(fmt, data[row0 + r], row, lut)
        bits = row.view(np.uint32)
        for i in range(row.size):
            tile[r, i] = _bf16(bits[i])


TILE_BYTES = 1 << 20              # bf16 bytes of decoded weight rows per prefill tile (stays in L2)


def quantized_matmul(x: np.ndarray, data: np.ndarray, fmt: int, n: int) -> np.ndarray:
    """x [M, K] f32 times the transpose of a block-quantized weight ([N, row bytes] of GGML type
    `fmt`) -> [M, N]: tiles of weight rows decoded to bf16, each multiplied by all activation rows
    (rounded to bf16 and packed once). For prefill: each weight row is decoded once per call."""
    rows = np.ascontiguousarray(x, dtype=np.float32)
    m, k = rows.shape
    packed_x = np.empty((-(-m // BLOCK) * 2, k // 32, TILE, TILE), np.uint32)
    _pack_activations(rows.view(np.uint32), packed_x)
    out = np.empty((m, n), np.float32)
    step = max(BLOCK, TILE_BYTES // (2 * k) // BLOCK * BLOCK)
    tile = np.empty((step, k), np.uint16)
    for row0 in range(0, n, step):
        part = tile[: min(step, n - row0)]
        _decode_bf16(data, fmt, F16_TABLE, row0, part)
        _gemm_rows(part, packed_x, NO_BIAS, out, row0, CONFIG, 0)
    return out


def takes(x, w, min_rows: int) -> bool:
    """Whether x [..., K] f32 times the transpose of w runs here: w a bf16 [N, K] array of a shape
    the kernel takes, more than `min_rows` activation rows, and AMX available."""
    return (type(w) is np.ndarray and w.ndim == 2 and w.dtype.name == "bfloat16" and x.dtype == np.float32
            and x.size > min_rows * w.shape[1] and fits(*w.shape) and available())


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None, epilogue: int = 0) -> np.ndarray:
    """epilogue(x [..., K] f32 @ w [N, K] (bf16).T + bias) -> [..., N] f32, into `out` when it is a
    C-ordered f32 buffer; `epilogue` indexes EPILOGUES. Weights within the repacking budget take the
    direct-store kernel."""
    n, k = w.shape
    rows = np.ascontiguousarray(x.reshape(-1, k)).view(np.uint32)
    shape = (*x.shape[:-1], n)
    result = out if out is not None and out.dtype == np.float32 and out.shape == shape and out.flags.c_contiguous \
        else np.empty(shape, np.float32)
    m_pad = -(-rows.shape[0] // BLOCK) * BLOCK
    packed = repacked(w)
    if packed is not None:
        seed = np.zeros(n, np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        xb = np.empty((m_pad, k), np.uint16)
        _to_bf16_rows(rows, xb)
        _gemm_packed(xb, rows.shape[0], packed, seed, result.reshape(-1, n), 0, CONFIG, numba.get_num_threads(), epilogue)
    else:
        add = NO_BIAS if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        packed_x = np.empty((m_pad // TILE, k // 32, TILE, TILE), np.uint32)
        _pack_activations(rows, packed_x)
        _gemm_rows(w.view(np.uint16), packed_x, add, result.reshape(-1, n), 0, CONFIG, epilogue)
    return result


@njit(inline="always")
def _pairs(t, row0, rows, col0, width, out, block):
    """out[block] = B-operand tile of t rows row0.. (the pair axis) by columns col0..col0+15:
    word [pair, c] holds t[row0 + 2 pair, col0 + c] (low) and t[row0 + 2 pair + 1, col0 + c] (high),
    bf16-rounded; rows past `rows` and columns past `width` are zero."""
    for pair in range(TILE):
        for c in range(TILE):
            word = np.uint32(0)
            if col0 + c < width:
                for half in range(2):
                    r = row0 + 2 * pair + half
                    if r < rows:
                        word |= _bf16(np.float32(t[r, col0 + c]).view(np.uint32)) << np.uint32(16 * half)
            out[block, pair, c] = word


@njit(parallel=True, cache=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz"})
def _attention(q, k, v, bias, scale, out, config):
    """out[b, h] = softmax(q[b, h] . k[b, h // g].T * scale + bias[b, h]) . v[b, h // g] for every
    (batch, head) in parallel, both products on the tiles: q, k, v and the probabilities rounded to
    bf16, scores, softmax and sums in f32. Head dims are multiples of 32; any strides."""
    batch, heads, rows, dim = q.shape
    kv_heads, keys, dv = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    q_pad, k_pad = -(-rows // TILE) * TILE, -(-keys // 32) * 32
    for task in prange(batch * heads):
        b, h = task // heads, task % heads
        kh = h // group
        _configure(config)
        qb = np.zeros((q_pad, dim), np.uint16)            # A operand: query rows
        for i in range(rows):
            for d in range(dim):
                qb[i, d] = _bf16(np.float32(q[b, h, i, d]).view(np.uint32))
        kt = k[b, kh].T                                    # [D, Sk]: pairs run along the head dim
        kp = np.empty((k_pad // TILE * (dim // 32), TILE, TILE), np.uint32)
        for kb in range(k_pad // TILE):
            for db in range(dim // 32):
                _pairs(kt, db * 32, dim, kb * TILE, keys, kp, kb * (dim // 32) + db)
        vp = np.empty((dv // TILE * (k_pad // 32), TILE, TILE), np.uint32)
        for db in range(dv // TILE):                      # pairs run along the keys
            for kb in range(k_pad // 32):
                _pairs(v[b, kh], kb * 32, keys, db * TILE, dv, vp, db * (k_pad // 32) + kb)
        scores = np.empty((TILE, k_pad), np.float32)
        probs = np.zeros((TILE, k_pad), np.uint16)
        acc = np.empty((TILE, TILE), np.float32)
        for qb0 in range(0, q_pad, TILE):
            for kb in range(k_pad // TILE):
                _zero(0)
                for db in range(dim // 32):
                    _load(4, qb, qb0 * dim + db * 32, dim * 2)
                    _load(6, kp, (kb * (dim // 32) + db) * TILE * TILE, 64)
                    _dot(0, 4, 6)
                _store(0, scores, kb * TILE, k_pad * 4)
            for i in range(min(TILE, rows - qb0)):
                best = -np.inf
                for j in range(keys):
                    scores[i, j] = scores[i, j] * scale + bias[b, h, qb0 + i, j]
                    best = max(best, scores[i, j])
                total = np.float32(0)
                for j in range(keys):
                    scores[i, j] = exp_f32(scores[i, j] - best)
                    total += scores[i, j]
                inv = np.float32(1) / total
                for j in range(keys):
                    probs[i, j] = _bf16(np.float32(scores[i, j] * inv).view(np.uint32))
            for db in range(dv // TILE):
                _zero(0)
                for kb in range(k_pad // 32):
                    _load(4, probs, kb * 32, k_pad * 2)
                    _load(6, vp, (db * (k_pad // 32) + kb) * TILE * TILE, 64)
                    _dot(0, 4, 6)
                _store(0, acc, 0, TILE * 4)
                for i in range(min(TILE, rows - qb0)):
                    out[b, h, qb0 + i, db * TILE: (db + 1) * TILE] = acc[i]
        _release()


def attention(q, k, v, bias, scale: float, out) -> np.ndarray:
    """sdpa on the tiles (see _attention): f32 q/k/v [B, H, S, D], additive bias broadcast to
    [B, H, Sq, Sk]; into `out` when it is a C-ordered f32 buffer of the result's shape."""
    shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    result = out if out is not None and out.dtype == np.float32 and out.shape == shape and out.flags.c_contiguous \
        else np.empty(shape, np.float32)
    _attention(q, k, v, np.broadcast_to(bias, (*shape[:3], k.shape[2])), np.float32(scale), result, CONFIG)
    return result


def takes_attention(q, k, v) -> bool:
    """f32 q, k, v with head dims in whole tiles (32 for q . k, 16 for p . v), AMX available."""
    return (all(isinstance(t, np.ndarray) and t.dtype == np.float32 for t in (q, k, v))
            and q.shape[-1] % 32 == 0 and v.shape[-1] % TILE == 0 and available())


def fits(n: int, k: int) -> bool:
    """Weight shapes the kernel takes: whole 32-row blocks, K in whole tile rows."""
    return n % BLOCK == 0 and k % 32 == 0

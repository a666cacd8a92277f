"""CUDA jet for attention over the paged KV cache: one program per (query row, kv head, share of the
row's context) reads its slots in tiles, the query heads of the group together (GQA), with an online
softmax; the last share of a (row, kv head) to finish merges them all (flash-decoding in one kernel:
a count per pair, in device memory). Products run on the tensor cores in f32 accuracy: tf32x3, or
two tf32 passes against a 16-bit cache, whose values tf32 holds exactly (fp32 FMA dots are several
times slower). With `spans`, a row reads only its own span of the context: a
batch's rows each read their own sequence, never the others' segments or the padding. Masked-out
keys weigh nothing. Prefill and decode share it. Over a compressed cache that keeps float copies of some
positions (paged_attention_copies), a row reads the copies of its span's first `sinks` and last `window`
positions in place of their codes, within the same tiles."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import CUDA, INT, F, device_jet, strided_rows
from soma_runtime.backends.cuda.kv_codecs import ON_DEVICE, codec_constants, curves, decoded, words
from soma_runtime.backends.cuda.rope import ROPE_INPUTS, rotated, turned_pairs, turns
from soma_runtime.ir.jets import jet
from soma_runtime.quant import kv


@triton.jit
def _dot(a, b, EXACT: tl.constexpr):
    """a @ b in f32 accuracy on the tensor cores: tf32x3, or where b's values are exact in tf32 (a 16-bit
    cache's), two tf32 passes of a's high and low parts."""
    if EXACT:
        high = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return tl.dot(high, b, input_precision="tf32") + tl.dot(a - high, b, input_precision="tf32")
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _slots(ctx_ptr, mask_ptr, t, end, s, T, kv_heads, kvh, HAS_MASK: tl.constexpr):
    """Context positions t of row s (those before `end`): their cache rows for head kvh and the mask's
    bias (-inf past `end`)."""
    row = tl.load(ctx_ptr + t, mask=t < end, other=0).to(tl.int64) * kv_heads + kvh
    if HAS_MASK:
        bias = tl.load(mask_ptr + s * T + t, mask=t < end, other=-float("inf"))
    else:
        bias = tl.where(t < end, 0.0, -float("inf"))
    return row, bias


@triton.jit
def _attend(q, keys, values, bias, top, total, acc, scale, softcap, EXACT: tl.constexpr):
    """The online softmax's running max, sum and output after one more tile."""
    scores = _dot(q, tl.trans(keys.to(tl.float32)), EXACT) * scale
    if softcap != 0:
        scores = softcap * (2 * tl.sigmoid(2 * scores / softcap) - 1)
    scores = scores + bias[None, :]
    new_top = tl.maximum(top, tl.max(scores, 1))
    safe_top = tl.where(new_top == -float("inf"), 0.0, new_top)       # all masked so far: nothing to rescale
    p = tl.exp(scores - safe_top[:, None])
    alpha = tl.exp(top - safe_top)
    acc = acc * alpha[:, None] + _dot(p, values.to(tl.float32), EXACT)
    return new_top, total * alpha + tl.sum(p, 1), acc


@triton.jit
def _copied(rows, copy_ptr, slot, use, row_width, kv_heads, kvh, width: tl.constexpr, n):
    """`rows` [BT, width] with the float copies of the tile's positions where `use` says, read from
    their copy slots `slot` [BT]."""
    at = (tl.where(use, slot, 0).to(tl.int64) * kv_heads + kvh) * row_width
    column = tl.arange(0, width)
    kept = tl.load(copy_ptr + at[:, None] + column[None, :], mask=use[:, None] & (column < n)[None, :], other=0.0)
    return tl.where(use[:, None], kept.to(tl.float32), rows)


@chained
@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, ctx_ptr, mask_ptr, spans_ptr, pos_ptr, freq_ptr, part_ptr, top_ptr, total_ptr,
                            count_ptr, out_ptr, curves_ptr, kc_ptr, vc_ptr, copy_ptr, sinks, window, q_stride, T, splits,
                            heads, kv_heads, dim, dv, k_width, v_width, scale, softcap, half, COPIES: tl.constexpr,
                            HAS_MASK: tl.constexpr, HAS_SPANS: tl.constexpr, ROPE: tl.constexpr,
                            NEOX: tl.constexpr, ROUND_Q: tl.constexpr, EXACT: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr,
                            BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr, K_CODEC: tl.constexpr,
                            K_BITS: tl.constexpr, K_SIZE: tl.constexpr, V_CODEC: tl.constexpr, V_BITS: tl.constexpr,
                            V_SIZE: tl.constexpr):
    """Query row s, kv head kvh, share c of the row's span (flash-decoding: shares in parallel): the
    share's unnormalized output, running max and sum for each query head of the group; the last share
    to finish merges them all (with one share, it stores its own). The span, the first tile's slots
    and mask and the queries' rope angles load before the wait (the step's inputs: none of its kernels
    writes them), each next tile's a tile ahead; keys and values load after the wait (earlier lost:
    bench/results/design-notes.md). A compressed cache's rows (k_width, v_width bytes; codec numbers
    K_CODEC, V_CODEC >= 0) are decoded as each tile loads; with COPIES, the float copies (copy slots at
    copy_ptr, -1 for none) of the span's first `sinks` and last `window` positions replace their codes."""
    s, kvh, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = tl.arange(0, BD)
    e = tl.arange(0, BV)
    lo, hi = 0, T
    if HAS_SPANS:
        lo = tl.maximum(tl.load(spans_ptr + 2 * s).to(tl.int32), 0)
        hi = tl.minimum(tl.load(spans_ptr + 2 * s + 1).to(tl.int32), T)
    share = tl.cdiv(tl.cdiv(hi - lo, splits), BT) * BT
    begin = lo + c * share
    end = tl.minimum(hi, begin + share)
    row, bias = _slots(ctx_ptr, mask_ptr, begin + tl.arange(0, BT), end, s, T, kv_heads, kvh, HAS_MASK)
    if ROPE:           # interleaved queries turn in registers, by pair
        at = d[None, :] if NEOX else 2 * tl.arange(0, BD // 2)[None, :]
        cos, sin = turns(at, tl.load(pos_ptr + s).to(tl.float32), freq_ptr, half, NEOX)
    after_prior()
    group = heads // kv_heads
    g = tl.arange(0, GROUP)
    g_ok = g < group
    h = s * heads + kvh * group + g
    top = tl.full((GROUP,), -float("inf"), tl.float32)
    total = tl.zeros((GROUP,), tl.float32)
    acc = tl.zeros((GROUP, BV), tl.float32)
    if begin < end:
        q_rows = q_ptr + s * q_stride + (kvh * group + g)[:, None] * dim
        q_ok = g_ok[:, None] & (d[None, :] < dim)
        q = tl.load(q_rows + d[None, :], mask=q_ok, other=0.0)
        if ROPE:                                  # the queries rotated as they are loaded
            if NEOX:
                q = rotated(q_rows, d[None, :], q.to(tl.float32), q_ok, cos, sin, half, NEOX)
            else:
                q = turned_pairs(q.to(tl.float32), cos, sin)
        if ROUND_Q:                               # an f16 cache under f32 queries: q at the cache's precision
            q = q.to(tl.float16)
        q = q.to(tl.float32)
        for t0 in tl.range(begin, end, BT):
            t = t0 + tl.arange(0, BT)
            k_ok, v_ok = (t < end)[:, None] & (d[None, :] < dim), (t < end)[:, None] & (e[None, :] < dv)
            if K_CODEC < 0:
                keys = tl.load(k_ptr + row[:, None] * k_width + d[None, :], mask=k_ok, other=0.0)
            else:
                keys = decoded(k_ptr, row, t < end, k_width, dim // 32, curves_ptr, K_CODEC, K_BITS, K_SIZE, BD // 32)
            if V_CODEC < 0:
                values = tl.load(v_ptr + row[:, None] * v_width + e[None, :], mask=v_ok, other=0.0)
            else:
                values = decoded(v_ptr, row, t < end, v_width, dv // 32, curves_ptr, V_CODEC, V_BITS, V_SIZE, BV // 32)
            if COPIES:                            # measured from the row's span, not this share's
                slot = tl.load(copy_ptr + t, mask=t < end, other=-1)
                use = (slot >= 0) & ((t < lo + sinks) | (t >= hi - window))
                keys = _copied(keys, kc_ptr, slot, use, dim, kv_heads, kvh, BD, dim)
                values = _copied(values, vc_ptr, slot, use, dv, kv_heads, kvh, BV, dv)
            top, total, acc = _attend(q, keys, values, bias, top, total, acc, scale, softcap, EXACT)
            row, bias = _slots(ctx_ptr, mask_ptr, t + BT, end, s, T, kv_heads, kvh, HAS_MASK)         # the next tile's
    if splits == 1:
        tl.store(out_ptr + h[:, None] * dv + e[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & (e[None, :] < dv))
    else:
        tl.store(part_ptr + (h * splits + c)[:, None] * dv + e[None, :], acc, mask=g_ok[:, None] & (e[None, :] < dv))
        tl.store(top_ptr + h * splits + c, top, mask=g_ok)
        tl.store(total_ptr + h * splits + c, total, mask=g_ok)
        tl.debug_barrier()                        # every thread's stores precede the count's release
        if tl.atomic_add(count_ptr + s * kv_heads + kvh, 1, sem="acq_rel") == splits - 1:
            tl.debug_barrier()
            _merge(part_ptr, top_ptr, total_ptr, out_ptr, s * heads + kvh * group, group, splits, dv, G, CHUNK, BV)
            tl.store(count_ptr + s * kv_heads + kvh, 0)            # ready for the next launch


@triton.jit
def _merge(part_ptr, top_ptr, total_ptr, out_ptr, h0, group, splits, dv, G: tl.constexpr, CHUNK: tl.constexpr, BV: tl.constexpr):
    """Heads h0 .. h0+group-1: the shares' partial results, rescaled to a running common max and
    normalized, CHUNK shares at a time (read past L1: other programs wrote them). A decode's shares
    come in one chunk: every load in flight at once, where a pass for the max first, then each chunk's
    outputs read after its maxima, took up to five rounds of dependent loads."""
    h = h0 + tl.arange(0, G)
    h_ok = h < h0 + group
    e = tl.arange(0, BV)
    best = tl.full((G,), -float("inf"), tl.float32)
    total = tl.zeros((G,), tl.float32)
    result = tl.zeros((G, BV), tl.float32)
    for c0 in tl.range(0, splits, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        ok = h_ok[:, None] & (c < splits)[None, :]
        at = h[:, None] * splits + c[None, :]                                              # [G, CHUNK]
        top = tl.load(top_ptr + at, mask=ok, other=-float("inf"), cache_modifier=".cg")
        totals = tl.load(total_ptr + at, mask=ok, other=0.0, cache_modifier=".cg")
        parts = tl.load(part_ptr + at[:, :, None] * dv + e[None, None, :], mask=ok[:, :, None] & (e < dv)[None, None, :],
                        other=0.0, cache_modifier=".cg")                                   # an empty share's are zeros
        new_best = tl.maximum(best, tl.max(top, 1))
        safe = tl.where(new_best == -float("inf"), 0.0, new_best)
        weight, alpha = tl.exp(top - safe[:, None]), tl.exp(best - safe)                    # 0 for empty shares, a first chunk
        total = total * alpha + tl.sum(totals * weight, 1)
        result = result * alpha[:, None] + tl.sum(parts * weight[:, :, None], 1)
        best = new_best
    tl.store(out_ptr + h[:, None] * dv + e[None, :], (result / total[:, None]).to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (e < dv)[None, :])


CACHE_MIXES = [("f32", c, c, INT, m, sp, *r) for c in ("f16", "bf16") for m in ("f32", "none") for sp in (INT, "none")
               for r in ROPE_INPUTS]
PROGRAMS = 512         # enough programs to fill an H200: fewer rows and heads split each row's span more
_counts: dict = {}     # per device: how many shares of each (row, kv head) have finished; the merger resets them


def tiling(width: int, shares: bool) -> tuple[int, int, int]:
    """(context positions per tile, pipeline stages, warps) for heads `width` wide, where a row's context
    is split in shares (a decode) or not (a prompt's rows). 64 slots, three stages, as a rule; for heads
    wider than 128 (Gemma's 256) 32 and two (their 64-slot tiles spill 0.5-1.6 KB of registers on sm_90,
    and three stages of 32 spill with an f32 cache). Eight warps for heads 128 wide (four spill) and a
    decode's shares; at 64 dims and fewer, its shares take 32 slots and four warps (faster, as swept on an
    H200); a prompt's rows narrower than 128 keep four (eight spilled)."""
    if width > 128:
        return 32, 2, 8
    if shares and width <= 64:
        return 32, 3, 4
    return 64, 3, 8 if width >= 128 or shares else 4


def finished_counts(device) -> torch.Tensor:
    """Zeroed counts for PROGRAMS (row, kv head) pairs: a context splits in shares only for fewer pairs.
    Made once, outside any graph capture (a plan's first run precedes its capture); kernels on two
    streams at once would share them, and the engine runs one step at a time."""
    if device not in _counts:
        _counts[device] = torch.zeros(PROGRAMS, dtype=torch.int32, device=device)
    return _counts[device]


@jet("paged_attention", CUDA, [(F, F, F, INT, m, sp, *r) for m in (F, "none") for sp in (INT, "none") for r in ROPE_INPUTS]
     + CACHE_MIXES, struct={"k_codec": ("none",), "v_codec": ("none",)})
@jet("paged_attention", CUDA, [("f32", "u8", "u8", INT, m, sp, *r) for m in (F, "none") for sp in (INT, "none")
                               for r in ROPE_INPUTS], struct={"k_codec": ON_DEVICE, "v_codec": ON_DEVICE})
@device_jet
def paged_attention(q, k_pages, v_pages, ctx_slots, mask, spans, positions=None, inv_freq=None, scale=None, softcap=0.0,
                    rope_style="neox", k_codec="none", v_codec="none"):
    rope = None if positions is None else (positions.expand(q.shape[0]).contiguous(), inv_freq.contiguous())
    return attend(q, k_pages, v_pages, ctx_slots, mask, spans, scale, softcap, k_codec, v_codec, rope, rope_style)


@jet("paged_attention_copies", CUDA, [("f32", "u8", "u8", INT, INT, c, c, INT) for c in ("f16", "f32")],
     struct={"k_codec": ON_DEVICE, "v_codec": ON_DEVICE})
@device_jet
def paged_attention_copies(q, k_pages, v_pages, ctx_slots, spans, k_copies, v_copies, copy_slots, scale=None, softcap=0.0,
                           k_codec="tq4", v_codec="tq4", sinks=0, window=0):
    copies = (k_copies.contiguous(), v_copies.contiguous(), copy_slots.contiguous(), int(sinks), int(window))
    return attend(q, k_pages, v_pages, ctx_slots, None, spans, scale, softcap, k_codec, v_codec, copies=copies)


def attend(q, k_pages, v_pages, ctx_slots, mask, spans, scale, softcap, k_codec, v_codec, rope=None, rope_style="neox",
           copies=None):
    """One launch of the kernel for either op: `rope` (positions, inv_freq) turns the queries as
    they load; `copies` (k_copies, v_copies, copy_slots, sinks, window) replace codes as the op says."""
    S, H, D = q.shape
    KV, T = k_pages.shape[2], ctx_slots.shape[0]
    Dv = v_pages.shape[3] if v_codec == "none" else kv.CODECS[v_codec].dim(v_pages.shape[3])
    (K_CODEC, K_BITS, K_SIZE), (V_CODEC, V_BITS, V_SIZE) = codec_constants(k_codec), codec_constants(v_codec)
    q = strided_rows(q, H * D)
    if mask is not None:
        mask = mask.to(torch.float32).expand(1, 1, S, T).reshape(S, T).contiguous()
    BT, stages, warps = tiling(max(D, Dv), S * KV < PROGRAMS)
    splits = max(1, min(triton.cdiv(PROGRAMS, S * KV), triton.cdiv(T, BT)))
    part = torch.empty((S * H * splits, Dv), dtype=torch.float32, device=q.device)
    top, total = (torch.empty(S * H * splits, dtype=torch.float32, device=q.device) for _ in range(2))
    out = torch.empty((S, H, Dv), dtype=q.dtype, device=q.device)
    BD, BV = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(Dv))
    G, SPLITS = triton.next_power_of_2(H // KV), triton.next_power_of_2(splits)
    keys, values = words(k_pages, k_codec), words(v_pages, v_codec)        # a row is shape[3] of these apart
    k_copies, v_copies, copy_slots, sinks, window = (q, q, q, 0, 0) if copies is None else copies
    # 16-bit caches hold values exact in tf32: their products need two passes, not three
    _paged_attention_kernel[(S, KV, splits)](
        q, keys, values, ctx_slots.contiguous(), q if mask is None else mask,
        q if spans is None else spans.contiguous(), q if rope is None else rope[0], q if rope is None else rope[1], part, top,
        total, finished_counts(q.device), out, curves(q.device), k_copies, v_copies, copy_slots, sinks, window, q.stride(0),
        T, splits, H, KV, D, Dv, keys.shape[3], values.shape[3], float(1 / math.sqrt(D) if scale is None else scale),
        float(softcap), 0 if rope is None else rope[1].shape[0], COPIES=copies is not None,
        HAS_MASK=mask is not None, HAS_SPANS=spans is not None,
        ROPE=rope is not None, NEOX=rope_style == "neox",
        ROUND_Q=k_pages.dtype == torch.float16 and q.dtype == torch.float32,
        EXACT=k_pages.dtype in (torch.float16, torch.bfloat16), GROUP=max(16, G), G=G, BT=BT, BD=BD, BV=BV,
        CHUNK=max(1, min(SPLITS, 8192 // (G * BV))), K_CODEC=K_CODEC, K_BITS=K_BITS, K_SIZE=K_SIZE, V_CODEC=V_CODEC,
        V_BITS=V_BITS, V_SIZE=V_SIZE, num_warps=warps, num_stages=stages)
    return out


@jet("sdpa", CUDA, [(F, F, F, F), (F, F, F, "none")])
@device_jet
def sdpa(q, k, v, mask=None, causal=False, scale=None, softcap=0.0, window=0, precision="f32"):
    """Whole-sequence attention [B, H, S, D] (an encoder's): torch's fused attention in f32, GQA heads
    grouped; a causal or windowed one bottom-right aligned as the op says, through an additive bias."""
    like, (_, H, S, D), (Hkv, T) = q.dtype, q.shape, k.shape[1:3]
    scale = 1 / math.sqrt(D) if scale is None else scale
    q, k, v = (t.to(torch.float32) for t in (q, k, v))
    bias = None if mask is None else mask.to(torch.float32)
    if causal or window:
        rows = torch.arange(S, device=q.device)[:, None] + (T - S)
        cols = torch.arange(T, device=q.device)[None, :]
        keep = (cols <= rows) if causal else torch.ones((S, T), dtype=torch.bool, device=q.device)
        keep = keep & (rows - cols < window) if window else keep
        hidden = torch.zeros((S, T), device=q.device).masked_fill(~keep, -math.inf)
        bias = hidden if bias is None else bias + hidden
    if softcap:
        k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
        scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
        out = torch.softmax(scores if bias is None else scores + bias, dim=-1) @ v
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=H != Hkv)
    return out.to(like)

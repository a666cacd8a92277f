"""CUDA jet for attention over the paged KV cache: one program per (query row, kv head, share of the
row's context) reads its slots in tiles, the query heads of the group together (GQA), with an online
softmax; a second kernel merges the shares (flash-decoding), unless each row has one. Products run on
the tensor cores as tf32x3 (f32 accuracy): as fp32 FMA dots, 128-wide heads took 94 us a layer on an
H200. With `spans`, a row reads only its own span of the context: a batch's rows each read their own
sequence, never the others' segments or the padding. Masked-out keys weigh nothing. Prefill and
decode share it."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import device_jet
from soma_runtime.backends.cuda.linear import ROPE_INPUTS, rotated
from soma_runtime.ir.jets import jet

CUDA = "cuda"
F = ("f32", "f16", "bf16")
INT = ("i32", "i64")


@chained
@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, ctx_ptr, mask_ptr, spans_ptr, pos_ptr, freq_ptr, part_ptr, top_ptr, total_ptr,
                            out_ptr, T, splits, heads, kv_heads, dim, dv, scale, softcap, half, HAS_MASK: tl.constexpr,
                            HAS_SPANS: tl.constexpr, ROPE: tl.constexpr, NEOX: tl.constexpr, ROUND_Q: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                            BV: tl.constexpr):
    """Query row s, kv head kvh, share c of the row's span (flash-decoding: shares in parallel, merged
    after): the share's unnormalized output, running max and sum for each query head of the group;
    with one share per row, the normalized output itself."""
    after_prior()
    s, kvh, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = heads // kv_heads
    g = tl.arange(0, GROUP)
    d = tl.arange(0, BD)
    e = tl.arange(0, BV)
    g_ok = g < group
    h = s * heads + kvh * group + g
    lo, hi = 0, T
    if HAS_SPANS:
        lo, hi = tl.maximum(tl.load(spans_ptr + 2 * s).to(tl.int32), 0), tl.minimum(tl.load(spans_ptr + 2 * s + 1).to(tl.int32), T)
    share = tl.cdiv(tl.cdiv(hi - lo, splits), BT) * BT
    begin = lo + c * share
    end = tl.minimum(hi, begin + share)
    if begin >= end:                              # past the row's span: an empty share
        if splits > 1:
            tl.store(top_ptr + h * splits + c, tl.full((GROUP,), -float("inf"), tl.float32), mask=g_ok)
            tl.store(total_ptr + h * splits + c, tl.zeros((GROUP,), tl.float32), mask=g_ok)
        return
    q_rows = q_ptr + (s * heads + kvh * group + g)[:, None] * dim
    q_ok = g_ok[:, None] & (d[None, :] < dim)
    q = tl.load(q_rows + d[None, :], mask=q_ok, other=0.0)
    if ROPE:                                      # the queries rotated as they are loaded
        q = rotated(q_rows, d[None, :], q.to(tl.float32), q_ok, tl.load(pos_ptr + s).to(tl.float32), freq_ptr, half, NEOX)
    if ROUND_Q:                                   # an f16 cache under f32 queries: q at the cache's precision
        q = q.to(tl.float16)
    q = q.to(tl.float32)
    top = tl.full((GROUP,), -float("inf"), tl.float32)
    total = tl.zeros((GROUP,), tl.float32)
    acc = tl.zeros((GROUP, BV), tl.float32)
    for t0 in tl.range(begin, end, BT):
        t = t0 + tl.arange(0, BT)
        t_ok = t < end
        if HAS_MASK:
            bias = tl.load(mask_ptr + s * T + t, mask=t_ok, other=-float("inf"))
        else:
            bias = tl.where(t_ok, 0.0, -float("inf"))
        slot = tl.load(ctx_ptr + t, mask=t_ok, other=0).to(tl.int64)
        row = (slot * kv_heads + kvh)
        keys = tl.load(k_ptr + row[:, None] * dim + d[None, :], mask=t_ok[:, None] & (d[None, :] < dim), other=0.0)
        scores = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="tf32x3") * scale
        if softcap != 0:
            scores = softcap * (2 * tl.sigmoid(2 * scores / softcap) - 1)
        scores = scores + bias[None, :]
        new_top = tl.maximum(top, tl.max(scores, 1))
        safe_top = tl.where(new_top == -float("inf"), 0.0, new_top)       # all masked so far: nothing to rescale
        p = tl.exp(scores - safe_top[:, None])
        alpha = tl.exp(top - safe_top)
        values = tl.load(v_ptr + row[:, None] * dv + e[None, :], mask=t_ok[:, None] & (e[None, :] < dv), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, values.to(tl.float32), input_precision="tf32x3")
        total = total * alpha + tl.sum(p, 1)
        top = new_top
    if splits == 1:
        tl.store(out_ptr + h[:, None] * dv + e[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & (e[None, :] < dv))
    else:
        tl.store(part_ptr + (h * splits + c)[:, None] * dv + e[None, :], acc, mask=g_ok[:, None] & (e[None, :] < dv))
        tl.store(top_ptr + h * splits + c, top, mask=g_ok)
        tl.store(total_ptr + h * splits + c, total, mask=g_ok)


@chained
@triton.jit
def _merge_kernel(part_ptr, top_ptr, total_ptr, out_ptr, splits, dv, SPLITS: tl.constexpr, BV: tl.constexpr):
    """One (row, head): the chunks' partial results, rescaled to their common max and normalized."""
    after_prior()
    h = tl.program_id(0)
    c = tl.arange(0, SPLITS)
    e = tl.arange(0, BV)
    c_ok = c < splits
    tops = tl.load(top_ptr + h * splits + c, mask=c_ok, other=-float("inf"))
    best = tl.max(tops, 0)
    weight = tl.where(tops == -float("inf"), 0.0, tl.exp(tops - tl.where(best == -float("inf"), 0.0, best)))
    total = tl.sum(tl.load(total_ptr + h * splits + c, mask=c_ok, other=0.0) * weight, 0)
    read = c_ok & (tops != -float("inf"))                  # a skipped chunk wrote no partial output
    parts = tl.load(part_ptr + (h * splits + c)[:, None] * dv + e[None, :], mask=read[:, None] & (e[None, :] < dv), other=0.0)
    result = tl.sum(parts * weight[:, None], 0) / total
    tl.store(out_ptr + h * dv + e, result.to(out_ptr.dtype.element_ty), mask=e < dv)


CACHE_MIXES = [("f32", c, c, INT, m, sp, *r) for c in ("f16", "bf16") for m in ("f32", "none") for sp in (INT, "none")
               for r in ROPE_INPUTS]
BT = 64                # context positions per tile
PROGRAMS = 512         # enough programs to fill an H200: fewer rows and heads split each row's span more


@jet("paged_attention", CUDA, [(F, F, F, INT, m, sp, *r) for m in (F, "none") for sp in (INT, "none") for r in ROPE_INPUTS]
     + CACHE_MIXES)
@device_jet
def paged_attention(q, k_pages, v_pages, ctx_slots, mask, spans, positions=None, inv_freq=None, scale=None, softcap=0.0,
                    rope_style="neox"):
    S, H, D = q.shape
    KV, Dv, T = k_pages.shape[2], v_pages.shape[3], ctx_slots.shape[0]
    q = q.contiguous()
    rope = None if positions is None else (positions.expand(S).contiguous(), inv_freq.contiguous())
    if mask is not None:
        mask = mask.to(torch.float32).expand(1, 1, S, T).reshape(S, T).contiguous()
    splits = max(1, min(triton.cdiv(PROGRAMS, S * KV), triton.cdiv(T, BT)))
    part = torch.empty((S * H * splits, Dv), dtype=torch.float32, device=q.device)
    top, total = (torch.empty(S * H * splits, dtype=torch.float32, device=q.device) for _ in range(2))
    out = torch.empty((S, H, Dv), dtype=q.dtype, device=q.device)
    BV = max(16, triton.next_power_of_2(Dv))
    _paged_attention_kernel[(S, KV, splits)](
        q, k_pages.contiguous(), v_pages.contiguous(), ctx_slots.contiguous(), q if mask is None else mask,
        q if spans is None else spans.contiguous(), q if rope is None else rope[0], q if rope is None else rope[1], part, top,
        total, out, T, splits, H, KV, D, Dv, float(1 / math.sqrt(D) if scale is None else scale), float(softcap),
        0 if rope is None else inv_freq.shape[0], HAS_MASK=mask is not None, HAS_SPANS=spans is not None, ROPE=rope is not None,
        NEOX=rope_style == "neox", ROUND_Q=k_pages.dtype == torch.float16 and q.dtype == torch.float32,
        GROUP=max(16, triton.next_power_of_2(H // KV)), BT=BT, BD=max(16, triton.next_power_of_2(D)), BV=BV)
    if splits > 1:
        _merge_kernel[(S * H,)](part, top, total, out, splits, Dv, SPLITS=max(2, triton.next_power_of_2(splits)), BV=BV)
    return out

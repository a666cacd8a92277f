"""CUDA jet for attention over the paged KV cache: one program per (query row, kv head) reads the
row's context slots in tiles, its query heads of the group together (GQA), with an online softmax;
masked-out keys (padding, other sequences of a batch) weigh nothing. Prefill and decode share it."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.device import device_jet
from soma_runtime.ir.jets import jet

CUDA = "cuda"
F = ("f32", "f16", "bf16")
INT = ("i32", "i64")


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, ctx_ptr, mask_ptr, out_ptr, T, heads, kv_heads, dim, dv, scale, softcap,
                            HAS_MASK: tl.constexpr, ROUND_Q: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr,
                            BD: tl.constexpr, BV: tl.constexpr):
    s, kvh = tl.program_id(0), tl.program_id(1)
    group = heads // kv_heads
    g = tl.arange(0, GROUP)
    d = tl.arange(0, BD)
    e = tl.arange(0, BV)
    g_ok = g < group
    q = tl.load(q_ptr + (s * heads + kvh * group + g)[:, None] * dim + d[None, :], mask=g_ok[:, None] & (d[None, :] < dim),
                other=0.0)
    if ROUND_Q:                                   # an f16 cache under f32 queries: q at the cache's precision
        q = q.to(tl.float16)
    q = q.to(tl.float32)
    top = tl.full((GROUP,), -float("inf"), tl.float32)
    total = tl.zeros((GROUP,), tl.float32)
    acc = tl.zeros((GROUP, BV), tl.float32)
    for t0 in tl.range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        t_ok = t < T
        if HAS_MASK:
            bias = tl.load(mask_ptr + s * T + t, mask=t_ok, other=-float("inf"))
        else:
            bias = tl.where(t_ok, 0.0, -float("inf"))
        slot = tl.load(ctx_ptr + t, mask=t_ok, other=0).to(tl.int64)
        row = (slot * kv_heads + kvh)
        keys = tl.load(k_ptr + row[:, None] * dim + d[None, :], mask=t_ok[:, None] & (d[None, :] < dim), other=0.0)
        scores = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee") * scale
        if softcap != 0:
            scores = softcap * (2 * tl.sigmoid(2 * scores / softcap) - 1)
        scores = scores + bias[None, :]
        new_top = tl.maximum(top, tl.max(scores, 1))
        safe_top = tl.where(new_top == -float("inf"), 0.0, new_top)       # all masked so far: nothing to rescale
        p = tl.exp(scores - safe_top[:, None])
        alpha = tl.exp(top - safe_top)
        values = tl.load(v_ptr + row[:, None] * dv + e[None, :], mask=t_ok[:, None] & (e[None, :] < dv), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, values.to(tl.float32), input_precision="ieee")
        total = total * alpha + tl.sum(p, 1)
        top = new_top
    result = acc / total[:, None]
    tl.store(out_ptr + (s * heads + kvh * group + g)[:, None] * dv + e[None, :], result.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & (e[None, :] < dv))


CACHE_MIXES = [("f32", c, c, INT, m) for c in ("f16", "bf16") for m in ("f32", "none")]   # f32 queries, half cache


@jet("paged_attention", CUDA, [(F, F, F, INT, F), (F, F, F, INT, "none")] + CACHE_MIXES)
@device_jet
def paged_attention(q, k_pages, v_pages, ctx_slots, mask, scale=None, softcap=0.0):
    S, H, D = q.shape
    KV, Dv, T = k_pages.shape[2], v_pages.shape[3], ctx_slots.shape[0]
    q = q.contiguous()
    if mask is not None:
        mask = mask.to(torch.float32).expand(1, 1, S, T).reshape(S, T).contiguous()
    out = torch.empty((S, H, Dv), dtype=q.dtype, device=q.device)
    group = H // KV
    _paged_attention_kernel[(S, KV)](
        q, k_pages.contiguous(), v_pages.contiguous(), ctx_slots.contiguous(), mask if mask is not None else q, out, T, H, KV,
        D, Dv, float(1 / math.sqrt(D) if scale is None else scale), float(softcap), HAS_MASK=mask is not None,
        ROUND_Q=k_pages.dtype == torch.float16 and q.dtype == torch.float32, GROUP=max(16, triton.next_power_of_2(group)),
        BT=64, BD=max(16, triton.next_power_of_2(D)), BV=max(16, triton.next_power_of_2(Dv)))
    return out

"""CPU jets for attention: sdpa through batched BLAS matmuls (on AMX tiles under the bf16
precision hint), and paged attention over the KV cache.

Paged attention reads keys and values where they sit in the cache pages: one numba pass per
(query row, kv head) that never copies the context and skips masked-out keys. It is as fast as
gather + BLAS even for 512-row prefills, and each row's result depends only on that row's visible
keys, so a sequence gets the same numbers alone or batched with others (continuous batching).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from soma_runtime.backends.cpu import amx, blas
from soma_runtime.backends.cpu.common import CPU, HALF, INT, ROPE_INPUTS, F, all_f32, deliver, f32, out_f32
from soma_runtime.backends.cpu.elementwise import attention_bias
from soma_runtime.backends.cpu.linear import rope
from soma_runtime.backends.cpu.simd import exp_f32, narrow, widen
from soma_runtime.dtypes import dtype_of
from soma_runtime.ir.jets import jet
from soma_runtime.quant import kv
from soma_runtime.quant.formats import F16_TABLE

CACHE_MIXES = [("f32", c, c, m) for c in HALF for m in ("f32", "none")]


@jet("sdpa", CPU, [(F, F, F, F), (F, F, F, "none")] + CACHE_MIXES)
def sdpa(q, k, v, mask, out=None, causal=False, scale=None, softcap=0.0, window=0, precision="f32"):
    like = dtype_of(q)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = np.float32(1 / math.sqrt(D) if scale is None else scale)
    if precision == "bf16" and not softcap and (mask is None or all_f32(mask)) and amx.takes_attention(q, k, v):
        bias = np.zeros((1, 1, 1, 1), np.float32) if mask is None else mask
        if causal or window:
            bias = bias + attention_bias(Sq, Sk, causal, window)
        return amx.attention(q, k, v, bias, scale, out)
    if k.dtype != q.dtype:                        # the cache's precision (see the op)
        q = q.astype(k.dtype)
    # GQA without copying k/v: the query heads of one kv head become rows of one batched matmul
    grouped = f32(q).reshape(B, Hkv, (Hq // Hkv) * Sq, D)
    if mask is None and not (causal or window or softcap) and grouped.shape[2] * Sk >= BLOCKED_SCORES:
        return deliver(blocked_attention(grouped * scale, f32(k), f32(v)).reshape(B, Hq, Sq, v.shape[3]), like, out)
    if not softcap:                               # scaled where it is cheapest: on q, not on the scores
        grouped, scale = grouped * scale, np.float32(1)
    scores = stacked_product(grouped, np.swapaxes(f32(k), -1, -2)).reshape(B, Hq, Sq, Sk)
    if scale != 1:
        scores *= scale
    if softcap:
        scores = np.tanh(scores / np.float32(softcap)) * np.float32(softcap)
    if mask is not None:
        scores += f32(mask)
    if causal or window:
        scores += attention_bias(Sq, Sk, causal, window)
    probs = softmax_in_place(scores).reshape(B, Hkv, (Hq // Hkv) * Sq, Sk)
    if dtype_of(v) != like:
        probs = probs.astype(v.dtype)
    return deliver(stacked_product(f32(probs), f32(v)).reshape(B, Hq, Sq, v.shape[3]), like, out)


def stacked_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [B, H, M, K] @ b [B, H, K, N] -> [B, H, M, N] f32, every head's product on the backend's pool."""
    out = np.empty((*a.shape[:-1], b.shape[-1]), np.float32)
    flat = lambda x: x.reshape(-1, *x.shape[-2:])          # a copy only where the heads cannot be one stack
    blas.matmul(flat(a), flat(b), out.reshape(-1, *out.shape[-2:]))
    return out


BLOCKED_SCORES = 1 << 20        # scores past this many per head are made a block of query rows at a time
QUERY_BLOCK = 256


def blocked_attention(q, k, v):
    """Unmasked attention [B, H, S, D] a head and a block of query rows at a time: the scores of a block
    stay in cache between the two matmuls and the softmax (a long encoder's full score matrix would not)."""
    out = np.empty(q.shape[:3] + v.shape[3:], np.float32)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            keys = np.ascontiguousarray(k[b, h].T)
            for start in range(0, q.shape[2], QUERY_BLOCK):
                rows = q[b, h, start:start + QUERY_BLOCK]
                scores = blas.matmul(rows, keys, np.empty((len(rows), keys.shape[1]), np.float32))
                blas.matmul(softmax_in_place(scores), v[b, h], out[b, h, start:start + QUERY_BLOCK])
    return out


def softmax_in_place(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of a fresh f32 array, overwriting it: rows in parallel, one pass each."""
    _softmax_rows(x.reshape(-1, x.shape[-1]))
    return x


@njit(parallel=True, cache=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz"})
def _softmax_rows(x):
    for r in prange(x.shape[0]):
        row = x[r]
        top = row.max()
        if top == -np.inf:                # a row that sees nothing: nan, as exp(-inf - -inf) gives
            row[:] = np.nan
            continue
        total = np.float32(0)
        for j in range(row.shape[0]):
            e = exp_f32(row[j] - top)
            row[j] = e
            total += e
        inv = np.float32(1) / total
        for j in range(row.shape[0]):
            row[j] *= inv


def load_row(cache, slot, head, out, codec, tables):
    """One cached head vector as f32 into `out`: an element each (f32, or f16 bits), or decoded from a
    codec's bytes (u8 caches, quant/kv.py)."""


@overload(load_row, inline="always")
def _load_row(cache, slot, head, out, codec, tables):
    if cache.dtype == types.uint8:
        def decoded(cache, slot, head, out, codec, tables):
            kv.decode_row(codec, cache[slot, head], out, *tables)
        return decoded

    def widened(cache, slot, head, out, codec, tables):
        for d in range(out.shape[0]):
            out[d] = widen(cache[slot, head, d])
    return widened


@njit(parallel=True, cache=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz"})
def _paged_attention(q, k, v, ctx, mask, spans, scale, softcap, precision, codecs, tables, copies, out):
    """q [S, H, D] f32; k, v [slots, KV, D] (f32, or f16 bits as uint16) or a codec's bytes [slots, KV,
    row_bytes] (codecs: the key's and the value's codec numbers); mask [S, T] or none ([0, 0]); out [S, H, Dv].
    Row s reads only context positions spans[s, 0] <= t < spans[s, 1] (its visible ones, masked-out
    keys within are skipped): padding, far context and other sequences' segments cost nothing.
    q and the probabilities round to `precision`'s type (uint16: f16, as the op says for an f16 cache
    under f32 queries). `copies`: float copies (k, v [slots, KV, D], each context position's slot there
    or -1 [T] (none: [0]), sinks, window): row s reads position t's copy for its first `sinks` positions
    and its last `window`."""
    rows, heads, dim = q.shape
    kv_heads, dv = k.shape[1], out.shape[2]
    group = heads // kv_heads
    masked = mask.shape[0] > 0
    k_copy, v_copy, copy_slots, sinks, window = copies
    copied = copy_slots.shape[0] > 0
    for task in prange(rows * kv_heads):
        s, kvh = task // kv_heads, task % kv_heads
        lo = max(spans[s, 0], 0)
        hi = max(min(spans[s, 1], ctx.shape[0]), lo)
        qg = np.empty((group, dim), np.float32)
        for g in range(group):
            for d in range(dim):
                qg[g, d] = narrow(q[s, kvh * group + g, d], precision)
        scores = np.full((group, hi - lo), -np.inf, np.float32)
        key = np.empty(dim, np.float32)
        for t in range(lo, hi):
            if masked and mask[s, t] == -np.inf:
                continue
            if copied and copy_slots[t] >= 0 and (t < lo + sinks or t >= hi - window):
                load_row(k_copy, copy_slots[t], kvh, key, -1, tables)
            else:
                load_row(k, ctx[t], kvh, key, codecs[0], tables)
            for g in range(group):
                acc = np.float32(0)
                for d in range(dim):
                    acc += qg[g, d] * key[d]
                score = acc * scale
                if softcap != 0:
                    score = np.float32(np.tanh(score / softcap)) * softcap
                scores[g, t - lo] = score + mask[s, t] if masked else score
        acc_out = np.zeros((group, dv), np.float32)
        value = np.empty(dv, np.float32)
        for g in range(group):             # softmax as ggml: exps summed in f64, scaled by the reciprocal
            top = scores[g].max()
            for t in range(hi - lo):       # apart from the f64 sum, so that the exps vectorize
                scores[g, t] = exp_f32(scores[g, t] - top)
            total = 0.0
            for t in range(hi - lo):
                total += scores[g, t]
            inv = np.float32(1.0 / total)
            for t in range(hi - lo):
                scores[g, t] = narrow(scores[g, t] * inv, precision)
        for t in range(lo, hi):
            if masked and mask[s, t] == -np.inf:
                continue
            if copied and copy_slots[t] >= 0 and (t < lo + sinks or t >= hi - window):
                load_row(v_copy, copy_slots[t], kvh, value, -1, tables)
            else:
                load_row(v, ctx[t], kvh, value, codecs[1], tables)
            for g in range(group):
                p = scores[g, t - lo]
                for d in range(dv):
                    acc_out[g, d] += p * value[d]
        for g in range(group):
            for d in range(dv):
                out[s, kvh * group + g, d] = acc_out[g, d]


DENSE_CONTEXT = 512      # a context every row shares, this long or longer, is read by BLAS where it lies


def shared_run(ctx_slots: np.ndarray, spans, rows: int) -> slice | None:
    """The cache slots every row reads, when they are the same span for all rows and one contiguous run of
    slots (an encoder's cross-attention keys, written at once): a slice of the flat cache."""
    if spans is None or rows == 0 or spans[0, 1] - spans[0, 0] < DENSE_CONTEXT or not (spans == spans[0]).all():
        return None
    lo, hi = int(spans[0, 0]), int(spans[0, 1])
    if lo < 0 or hi > len(ctx_slots):
        return None
    slots = ctx_slots[lo:hi]
    return slice(int(slots[0]), int(slots[0]) + len(slots)) if (np.diff(slots) == 1).all() else None


def dense_attention(q, k_pages, v_pages, run: slice, scale) -> np.ndarray:
    """q [S, H, D] over keys/values [T, KV, D] viewed in place: per kv head, two BLAS matmuls."""
    keys, values = k_pages.reshape(-1, *k_pages.shape[2:])[run], v_pages.reshape(-1, *v_pages.shape[2:])[run]
    S, H, D = q.shape
    KV = keys.shape[1]
    group = H // KV
    out = np.empty((S, H, values.shape[2]), np.float32)
    for h in range(KV):
        rows = (q[:, h * group:(h + 1) * group] * scale).reshape(S * group, D)
        probs = softmax_in_place(blas.matmul(rows, keys[:, h].T, np.empty((len(rows), len(keys)), np.float32)))
        heads = blas.matmul(probs, values[:, h], np.empty((S * group, values.shape[2]), np.float32))
        out[:, h * group:(h + 1) * group] = heads.reshape(S, group, -1)
    return out


def visible_spans(mask: np.ndarray) -> np.ndarray:
    """[S, 2]: each row's first and one-past-last unmasked context position."""
    visible = mask != -np.inf
    first = visible.argmax(axis=1)
    last = mask.shape[1] - visible[:, ::-1].argmax(axis=1)
    return np.where(visible.any(axis=1)[:, None], np.stack([first, last], axis=1), 0).astype(np.int64)


def span_mask(spans: np.ndarray, T: int) -> np.ndarray:
    """[1, 1, S, T]: 0 inside each row's span, -inf outside."""
    column = np.arange(T)[None, :]
    return np.where((spans[:, :1] <= column) & (column < spans[:, 1:]), 0, -np.inf).astype(np.float32)[None, None]


def flat_cache(pages: np.ndarray) -> np.ndarray:
    """Pages [P, block, H, D] as [slots, H, D]; f16 as its bits (numba has no float16)."""
    flat = pages.reshape(-1, *pages.shape[2:])
    return flat.view(np.uint16) if flat.dtype == np.float16 else flat


KERNEL_TABLES = (F16_TABLE, *kv.kernel_tables())
PLAIN = np.array([-1, -1], np.int64)
NO_COPIES = (np.zeros((1, 1, 1), np.uint16), np.zeros((1, 1, 1), np.uint16), np.zeros(0, np.int64), 0, 0)
ATTENTION_INPUTS = [(m, sp, *r) for m in (F, "none") for sp in (INT, "none") for r in ROPE_INPUTS]


@jet("paged_attention", CPU, [("f32", "u8", "u8", INT, *rest) for rest in ATTENTION_INPUTS],
     struct={"k_codec": tuple(kv.CODECS), "v_codec": tuple(kv.CODECS)})
@jet("paged_attention", CPU, [(F, F, F, INT, *rest) for rest in ATTENTION_INPUTS]
     + [("f32", c, c, INT, m, sp, *r) for c in HALF for m in ("f32", "none") for sp in (INT, "none") for r in ROPE_INPUTS],
     struct={"k_codec": ("none",), "v_codec": ("none",)})
def paged_attention(q, k_pages, v_pages, ctx_slots, mask, spans, positions=None, inv_freq=None, out=None, scale=None,
                    softcap=0.0, rope_style="neox", k_codec="none", v_codec="none"):
    if positions is not None:
        q = rope(q, positions, inv_freq, style=rope_style)
    like = dtype_of(q)
    S, H, D = q.shape
    T = ctx_slots.shape[0]
    scale = np.float32(1 / math.sqrt(D) if scale is None else scale)
    if k_codec != "none":
        return compressed_attention(q, k_pages, v_pages, ctx_slots, mask, spans, scale, softcap, k_codec, v_codec, NO_COPIES,
                                    like, out)
    fits = k_pages.dtype in (np.float32, np.float16) and (mask is None or mask.shape == (1, 1, S, T))
    if not fits:
        mask = np.zeros((1, 1, S, T), np.float32) if mask is None else mask
        if spans is not None:
            mask = mask + span_mask(spans, T)
        keys, values = (np.take(p.reshape(-1, *p.shape[2:]), ctx_slots, axis=0).transpose(1, 0, 2)[None]
                        for p in (k_pages, v_pages))
        result = sdpa(q.transpose(1, 0, 2)[None], keys, values, mask, scale=scale, softcap=softcap)
        return deliver(result[0].transpose(1, 0, 2), like, out)
    if (run := shared_run(ctx_slots, spans, S)) is not None and mask is None and not softcap and k_pages.dtype == np.float32 \
            and q.dtype == np.float32:
        return deliver(dense_attention(q, k_pages, v_pages, run, scale), like, out)
    result = out_f32(out, (S, H, v_pages.shape[3]))
    precision = np.uint16(0) if k_pages.dtype == np.float16 and q.dtype != np.float16 else np.float32(0)
    rows_mask, visible = row_spans(spans, mask, S, T)
    _paged_attention(f32(q), flat_cache(k_pages), flat_cache(v_pages), ctx_slots, rows_mask, visible,
                     scale, np.float32(softcap), precision, PLAIN, KERNEL_TABLES, NO_COPIES, result)
    return result if result is out else deliver(result, like, out)


def row_spans(spans, mask, S: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's mask ([S, T], or [0, 0] for none) and each row's visible span [S, 2]: as given (masked
    keys within are skipped), else the mask's visible ranges, else all."""
    rows_mask = np.zeros((0, 0), np.float32) if mask is None else np.ascontiguousarray(f32(mask)[0, 0])
    if spans is not None:
        return rows_mask, np.ascontiguousarray(spans, dtype=np.int64)
    return rows_mask, np.tile(np.array([0, T], np.int64), (S, 1)) if mask is None else visible_spans(rows_mask)


DECODED_ONCE = 16      # a step with this many rows or more decodes its context once, not once per row


def compressed_attention(q, k_pages, v_pages, ctx_slots, mask, spans, scale, softcap, k_codec, v_codec, copies, like, out):
    """Attention over a compressed cache's pages: a decode row's keys and values decoded where the kernel
    reads them; a prompt chunk's context decoded once for the step (every row reads it), into a buffer
    the step lets go. Each row reads the float copies (`copies`, the kernel's) of its sinks and window."""
    S, H, _ = q.shape
    T = ctx_slots.shape[0]
    if mask is not None and mask.shape != (1, 1, S, T):
        mask = np.broadcast_to(mask, (1, 1, S, T))
    rows_mask, visible = row_spans(spans, mask, S, T)
    result = out_f32(out, (S, H, kv.CODECS[v_codec].dim(v_pages.shape[3])))
    keys, values = flat_cache(k_pages), flat_cache(v_pages)
    codecs = np.array([kv.CODEC_IDS[k_codec], kv.CODEC_IDS[v_codec]], np.int64)
    if S >= DECODED_ONCE:
        keys, values = (kv.decode(codec, np.take(pages, ctx_slots, axis=0))
                        for codec, pages in ((k_codec, keys), (v_codec, values)))
        ctx_slots, codecs = np.arange(T, dtype=np.int64), PLAIN
    _paged_attention(f32(q), keys, values, ctx_slots, rows_mask, visible, scale, np.float32(softcap), np.float32(0), codecs,
                     KERNEL_TABLES, copies, result)
    return result if result is out else deliver(result, like, out)


@jet("paged_attention_copies", CPU, [("f32", "u8", "u8", INT, INT, c, c, INT) for c in ("f16", "f32")])
def paged_attention_copies(q, k_pages, v_pages, ctx_slots, spans, k_copies, v_copies, copy_slots, out=None, scale=None,
                           softcap=0.0, k_codec="tq4", v_codec="tq4", sinks=0, window=0):
    """Attention over a compressed cache's pages, each row reading the float copies of its sinks and window
    (the op's) where the cache keeps them."""
    scale = np.float32(1 / math.sqrt(q.shape[2]) if scale is None else scale)
    slots = np.ascontiguousarray(copy_slots, dtype=np.int64)
    copies = (flat_cache(k_copies), flat_cache(v_copies), slots, int(sinks), int(window))
    return compressed_attention(q, k_pages, v_pages, ctx_slots, None, spans, scale, softcap, k_codec, v_codec, copies,
                                dtype_of(q), out)

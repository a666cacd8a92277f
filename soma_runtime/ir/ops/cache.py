"""The paged KV cache: pages [P, block, H, D]; a slot is page * block + offset. A compressed cache
(`codec`, quant/kv.py) keeps each head's vector as bytes: pages u8 [P, block, H, row_bytes(D)],
written by casting to the codec and read by decoding (the dequant atom); beside them it may keep float
copies of some positions (a sequence's first, and those near each query) that attention reads instead."""
from __future__ import annotations

import math

from soma_runtime.ir.atoms import Ref
from soma_runtime.ir.graph import Sym, TensorMeta, same_dim
from soma_runtime.ir.ops.base import broadcast_shapes, check, float_dtype, matmul_nk, op, same_dtype, softmax_atoms
from soma_runtime.ir.ops.linear import rope, rope_rule, sdpa
from soma_runtime.quant.kv import CODECS

CODEC_CHOICES = ("none", *CODECS)
CODECS_ONLY = tuple(CODECS)


def cache_rule(pages: TensorMeta, dim, codec: str, what: str = "pages"):
    """Pages of a float cache, or the bytes of `codec` for head vectors of `dim` elements."""
    if codec == "none":
        float_dtype(pages, what)
        return
    check(codec in CODECS, f"unknown KV codec {codec!r}; known: {', '.join(CODECS)}")
    check(pages.dtype == "u8", f"{what} of a {codec} cache must be u8 bytes, got {pages.dtype}")
    if isinstance(dim, int) and isinstance(pages.shape[-1], int):
        check(dim % 32 == 0 and pages.shape[-1] == CODECS[codec].row_bytes(dim),
              f"{what}: a {codec} row of {dim} elements is {CODECS[codec].row_bytes(dim) if dim % 32 == 0 else '?'} bytes, "
              f"the pages hold {pages.shape[-1]}")


def cached_dim(pages: TensorMeta, codec: str):
    """The head dim a cache's pages hold."""
    last = pages.shape[-1]
    return last if codec == "none" or not isinstance(last, int) else CODECS[codec].dim(last)


def rope_inputs_rule(x, positions, inv_freq, what):
    """An op's optional rope inputs: both or neither, as the rope op takes them."""
    check((positions is None) == (inv_freq is None), f"{what}: positions and inv_freq come together")
    if positions is not None:
        rope_rule([x, positions, inv_freq], {})


def kv_append_rule(metas, attrs):
    pages, new, slots = metas[:3]
    positions, inv_freq, v_pages, v_new = list(metas[3:7]) + [None] * (7 - len(metas))
    rope_inputs_rule(new, positions, inv_freq, "kv_append")
    check(slots.dtype in ("i32", "i64"), "slots must be integer")
    check((v_pages is None) == (v_new is None), "kv_append: v_pages and v_new come together")
    check(v_pages is None or all(same_dim(a, b) is not False for a, b in zip(v_pages.shape, pages.shape)),
          "kv_append: value pages must have the key pages' shape")
    pairs = [(pages, new)] + ([(v_pages, v_new)] if v_pages is not None else [])
    for cache, rows in pairs:
        check(cache.ndim == 4 and rows.ndim >= 2, "kv_append takes pages [P, block, H, D] and new [..., H, D]")
        cache_rule(cache, rows.shape[-1], attrs["codec"])
        float_dtype(rows)
        check(same_dim(cache.shape[2], rows.shape[-2]) is not False and
              same_dim(cached_dim(cache, attrs["codec"]), rows.shape[-1]) is not False, "head shape differs from the cache's")
        check(all(same_dim(a, b) is not False for a, b in zip(rows.shape[:-2], new.shape[:-2])), "values and keys differ in rows")
    return [cache for cache, _ in pairs]


@op("kv_append", ["pages", "new", "slots", "positions?", "inv_freq?", "v_pages?", "v_new?"], kv_append_rule,
    attrs={"style": "neox", "codec": "none"}, struct={"style": ("neox", "interleaved"), "codec": CODEC_CHOICES},
    stateful=True, view=True, aliases=(0, 5), ranks=(4, 3, 1, 1, 1, 4, 3))
def kv_append(A, pages, new, slots, positions=None, inv_freq=None, v_pages=None, v_new=None, style="neox", codec="none"):
    """Rows of `new` [..., H, D] into the cache slots; with positions and inv_freq, rotated first (rope:
    a key is stored rotated, in one pass). With v_pages and v_new, a layer's values go into the same
    slots of their own pages as well (unrotated): one kernel writes both. With a codec, each head's
    row is stored as its bytes (both caches' the same)."""
    if positions is not None and inv_freq is not None:
        new = Ref(rope(A, new, positions, inv_freq, style).index, new.shape, new.dtype)
    written = scattered(A, pages, new, slots, codec)
    return written if v_pages is None or v_new is None else (written, scattered(A, v_pages, v_new, slots, codec))


def scattered(A, pages, new, slots, codec):
    """The pages with rows of `new` written into their slots, in the cache's dtype (or codec)."""
    P, block, H, D = pages.shape
    flat = A.read("reshape", pages, shape=(P * block, H, D))
    rows = A.read("reshape", new, shape=(-1, H, new.shape[-1]))
    if codec != "none":
        rows = A.read("cast", rows, struct=(codec,))
    elif new.dtype != pages.dtype:          # values are stored in the cache's dtype
        rows = A.read("cast", rows, struct=(pages.dtype,))
    written = A.write("scatter", flat, rows, A.read("reshape", slots, shape=(-1,)), axis=0)
    return A.read("reshape", written, shape=pages.shape)


def kv_read_rule(metas, attrs):
    pages, slots = metas
    check(pages.ndim == 4, "kv_read takes pages [P, block, H, D]")
    cache_rule(pages, cached_dim(pages, attrs["codec"]), attrs["codec"])
    check(slots.dtype in ("i32", "i64"), "slots must be integer")
    decoded = attrs["codec"] != "none"
    return [TensorMeta((*slots.shape, pages.shape[2], cached_dim(pages, attrs["codec"])), "f32" if decoded else pages.dtype)]


@op("kv_read", ["pages", "slots"], kv_read_rule, attrs={"codec": "none"}, struct={"codec": CODEC_CHOICES}, ranks=(4, 1))
def kv_read(A, pages, slots, codec="none"):
    """The cached head vectors at `slots` [..., H, D] (a compressed cache's decoded to f32)."""
    P, block, H, D = pages.shape
    rows = A.read("take", A.read("reshape", pages, shape=(P * block, H, D)), slots, axis=0)
    return rows if codec == "none" else A.read("dequant", rows, struct=(codec,))


def paged_attention_rule(metas, attrs):
    q, k_pages, v_pages, ctx = metas[:4]
    mask, spans, positions, inv_freq = list(metas[4:8]) + [None] * (8 - len(metas))
    rope_inputs_rule(q, positions, inv_freq, "paged_attention")
    float_dtype(q)
    check(q.ndim == 3, "paged_attention takes q as [S, H, D]")
    check(k_pages.ndim == 4 and v_pages.ndim == 4, "paged_attention takes pages as [P, block, H, D]")
    k_codec, v_codec = attrs["k_codec"], attrs["v_codec"]
    if k_codec == v_codec == "none":
        same_dtype(k_pages, v_pages)
    cache_rule(k_pages, q.shape[2], k_codec, "k_pages")
    cache_rule(v_pages, cached_dim(v_pages, v_codec), v_codec, "v_pages")
    check(ctx.ndim == 1 and ctx.dtype in ("i32", "i64"), "ctx_slots must be a 1-D integer tensor")
    check(same_dim(q.shape[2], cached_dim(k_pages, k_codec)) is not False, "q and cached k head dims differ")
    if isinstance(q.shape[1], int) and isinstance(k_pages.shape[2], int):
        check(q.shape[1] % k_pages.shape[2] == 0, f"query heads {q.shape[1]} not a multiple of kv heads {k_pages.shape[2]}")
    if mask is not None:
        float_dtype(mask, "mask")
        broadcast_shapes((1, q.shape[1], q.shape[0], ctx.shape[0]), mask.shape)
    if spans is not None:
        check(spans.dtype in ("i32", "i64"), "spans must be integer")
        check(spans.ndim == 2 and same_dim(spans.shape[0], q.shape[0]) is not False and same_dim(spans.shape[1], 2) is not False,
              f"spans must be [{q.shape[0]}, 2], got {list(spans.shape)}")
    return [TensorMeta((q.shape[0], q.shape[1], cached_dim(v_pages, v_codec)), q.dtype)]


@op("paged_attention", ["q", "k_pages", "v_pages", "ctx_slots", "mask?", "spans?", "positions?", "inv_freq?"],
    paged_attention_rule, attrs={"scale": None, "softcap": 0.0, "rope_style": "neox", "k_codec": "none", "v_codec": "none"},
    struct={"softcap": (0.0, 30.0), "rope_style": ("neox", "interleaved"), "k_codec": CODEC_CHOICES, "v_codec": CODEC_CHOICES},
    tol=4.0, ranks=(3, 4, 4, 1, 4, 2, 1, 1))
def paged_attention(A, q, k_pages, v_pages, ctx_slots, mask, spans, positions, inv_freq, scale, softcap, rope_style,
                    k_codec, v_codec):
    """New queries [S, H, D] attend over the cached keys/values at ctx_slots: kv_read, then sdpa on
    [1, H, len, D] views (mask [1, 1, S, T] additive); out [S, H, Dv]. With spans [S, 2], row s sees
    only context positions spans[s, 0] <= t < spans[s, 1] (a batch's rows, each its own sequence's
    segment), so a kernel reads nothing else. With positions and inv_freq, the queries are rotated
    first (rope, as the kernel loads them). Compressed pages (k_codec, v_codec) are read as their
    decoded values. One kernel per layer on CPU."""
    S, H, D = q.shape
    T, KV = ctx_slots.shape[0], k_pages.shape[2]
    Dv = v_pages.shape[3] if v_codec == "none" else CODECS[v_codec].dim(v_pages.shape[3])
    if positions is not None and inv_freq is not None:
        q = Ref(rope(A, q, positions, inv_freq, rope_style).index, q.shape, q.dtype)
    keys, values = kv_read(A, k_pages, ctx_slots, k_codec), kv_read(A, v_pages, ctx_slots, v_codec)
    if spans is not None:
        mask = span_mask(A, mask, spans, S, T)
    key_dtype, value_dtype = ("f32" if c != "none" else p.dtype for c, p in ((k_codec, k_pages), (v_codec, v_pages)))
    out = sdpa(A, heads_first(A, q, (1, H, S, D), q.dtype), heads_first(A, keys, (1, KV, T, D), key_dtype),
               heads_first(A, values, (1, KV, T, Dv), value_dtype), mask, False, scale, softcap, 0, "f32")
    return A.read("transpose", A.read("reshape", out, shape=(H, S, Dv)), axis1=0, axis2=1)


def paged_attention_copies_rule(metas, attrs):
    q, k_pages, v_pages, ctx, spans, k_copies, v_copies, copy_slots = metas
    out = paged_attention_rule([q, k_pages, v_pages, ctx, None, spans], attrs)
    check(attrs["k_codec"] != "none" and attrs["v_codec"] != "none", "paged_attention_copies reads a compressed cache's pages")
    for copies, cached in ((k_copies, k_pages), (v_copies, v_pages)):
        float_dtype(copies, "copies")
        check(copies.ndim == 4 and same_dim(copies.shape[2], cached.shape[2]) is not False,
              "copies are pages [P, block, H, D] of the cache's heads")
    check(same_dim(k_copies.shape[3], q.shape[2]) is not False, "key copies and queries differ in head dim")
    check(copy_slots.ndim == 1 and copy_slots.dtype in ("i32", "i64") and same_dim(copy_slots.shape[0], ctx.shape[0])
          is not False, "copy_slots must be an integer tensor [T]: each context slot's copy slot, or -1")
    return out


@op("paged_attention_copies", ["q", "k_pages", "v_pages", "ctx_slots", "spans", "k_copies", "v_copies", "copy_slots"],
    paged_attention_copies_rule, attrs={"scale": None, "softcap": 0.0, "k_codec": "tq4", "v_codec": "tq4", "sinks": 0,
                                        "window": 0},
    struct={"softcap": (0.0, 30.0), "k_codec": CODECS_ONLY, "v_codec": CODECS_ONLY}, tol=4.0, ranks=(3, 4, 4, 1, 2, 4, 4, 1))
def paged_attention_copies(A, q, k_pages, v_pages, ctx_slots, spans, k_copies, v_copies, copy_slots, scale, softcap, k_codec,
                           v_codec, sinks, window):
    """paged_attention over a compressed cache that keeps float copies of some positions beside its codes
    (k_copies, v_copies: float pages; copy_slots [T]: the copy slot of each context slot, or -1): row s
    reads position t's copy, where it has one, for its first `sinks` positions (t < spans[s, 0] + sinks)
    and its last `window` (t >= spans[s, 1] - window), the codes elsewhere. A row's numbers depend on its
    own span alone, however a sequence's rows are split into steps. One kernel per layer on CPU."""
    S, T, KV = q.shape[0], ctx_slots.shape[0], k_pages.shape[2]
    coded = kv_read(A, k_pages, ctx_slots, k_codec), kv_read(A, v_pages, ctx_slots, v_codec)
    copies = float_copies(A, k_copies, v_copies, copy_slots, T)
    chosen = copied(A, spans, copy_slots, T, window, sinks)
    return attention_with_copies(A, q, coded, copies, span_mask(A, None, spans, S, T), chosen, scale, softcap, KV,
                                 CODECS[v_codec].dim(v_pages.shape[3]))


def heads_first(A, x, shape, dtype):
    """[len, heads, dim] -> [1, heads, len, dim], its shape known."""
    return Ref(A.read("expand", A.read("transpose", x, axis1=0, axis2=1), axis=0).index, shape, dtype)


def float_copies(A, k_float, v_float, float_slots, T):
    """The float copies [T, KV, D] of each context slot's key and value (slot 0's where it has none)."""
    slots = A.cmp("max", float_slots, A.param(0))
    return tuple(Ref(A.read("cast", kv_read(A, pages, slots), struct=("f32",)).index, (T, pages.shape[2], pages.shape[3]), "f32")
                 for pages in (k_float, v_float))


def copied(A, spans, float_slots, T, window, sinks):
    """[S, T]: whether row s reads position t's float copy: it has one, and t is among the row's first
    `sinks` or last `window` positions."""
    column = A.read("iota", n=T, axis=1, ndim=2)
    lo = A.read("slice", spans, axis=1, start=0, stop=1)
    hi = A.read("slice", spans, axis=1, start=1, stop=2)
    near = A.cmp("max", A.cmp("le", A.sub(hi, A.param(window)), column), A.cmp("lt", column, A.add(lo, A.param(sinks))))
    has = A.cmp("le", A.param(0), A.read("reshape", float_slots, shape=(1, T)))
    return A.mul(near, has)


def attention_with_copies(A, q, coded, copies, mask, chosen, scale, softcap, KV, Dv):
    """Attention where each row reads each position's key and value from its codes or from its float copy,
    as `chosen` [S, T] says: both scores computed, one kept per position, the values weighed alike; `mask`
    [1, 1, S, T] additive (the spans' included)."""
    S, H, D = q.shape
    T = copies[0].shape[0]
    grouped = A.read("reshape", heads_first(A, q, (1, H, S, D), q.dtype), shape=(1, KV, (H // KV) * S, D))

    def scores_of(keys):                   # [T, KV, D] -> [1, H, S, T]
        heads = A.read("expand", A.read("transpose", keys, axis1=0, axis2=1), axis=0)
        return A.read("reshape", matmul_nk(A, grouped, heads), shape=(1, H, S, T))
    scores = A.cmp("select", chosen, scores_of(copies[0]), scores_of(coded[0]))
    if scale is None:
        scale = 1 / math.sqrt(D) if isinstance(D, int) else Sym(f"1/sqrt({D})")
    scores = A.mul(scores, A.param(scale))
    if softcap:
        scores = A.mul(A.exp("tanh", A.mul(scores, A.param(1 / softcap))), A.param(softcap))
    probs = softmax_atoms(A, A.add(scores, mask), -1)
    out = None
    for weights, values in ((A.cmp("select", chosen, probs, A.lit(0.0)), copies[1]),
                            (A.cmp("select", chosen, A.lit(0.0), probs), coded[1])):
        heads = A.read("expand", A.read("permute", values, perm=(1, 2, 0)), axis=0)        # [1, KV, Dv, T]
        part = matmul_nk(A, A.read("reshape", weights, shape=(1, KV, (H // KV) * S, T)), heads)
        out = part if out is None else A.add(out, part)
    return A.read("transpose", A.read("reshape", out, shape=(H, S, Dv)), axis1=0, axis2=1)


def span_mask(A, mask, spans, S, T):
    """The additive mask with everything outside each row's span hidden: [1, 1, S, T]."""
    column = A.read("iota", n=T, axis=1, ndim=2)
    lo = A.read("slice", spans, axis=1, start=0, stop=1)
    hi = A.read("slice", spans, axis=1, start=1, stop=2)
    inside = A.mul(A.cmp("le", lo, column), A.cmp("lt", column, hi))
    hidden = A.read("reshape", A.cmp("select", inside, A.lit(0.0), A.lit(-math.inf)), shape=(1, 1, S, T))
    return hidden if mask is None else A.add(mask, hidden)

"""One op test for every backend: each op, several shapes and dtypes, against PyTorch in the same run.

f32 must agree within 1e-5 x scale, f16 within 1e-3 x scale (scale = max(1, max |reference|)).
PyTorch computes in f32 from the same (already rounded) inputs.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from soma_runtime.backends import run_op
from soma_runtime.ir.jets import max_error
from soma_runtime.quant import kv
from tests.backends import BACKENDS

TOL = {"f32": 1e-5, "f16": 1e-3}
NP = {"f32": np.float32, "f16": np.float16}
CASES = []


def case(op, make, ref, dtypes=("f32", "f16"), id="", **attrs):
    for dt in dtypes:
        CASES.append(pytest.param(op, make, ref, dt, attrs, id=f"{op}-{id}-{dt}" if id else f"{op}-{dt}"))


def randn(*shape, rng=None):
    return (rng or np.random.default_rng(0)).standard_normal(shape).astype(np.float32)


def mk(*shapes, seed=0, positive=()):
    """A factory of float inputs with the given shapes (inputs listed in `positive` kept > 0.5)."""
    def make(dt):
        rng = np.random.default_rng(seed)
        out = []
        for i, s in enumerate(shapes):
            x = randn(*s, rng=rng)
            if i in positive:
                x = np.abs(x) + 0.5
            out.append(x.astype(NP[dt]))
        return out
    return make


def non_contiguous(make):
    return lambda dt: [np.swapaxes(x.copy().reshape(x.shape[::-1]), 0, -1) if x.ndim > 1 else x for x in make(dt)]


# elementwise and activations
for name, fn in {"add": torch.add, "sub": torch.sub, "mul": torch.mul}.items():
    case(name, mk((3, 5), (5,)), fn, id="row-broadcast")
    case(name, mk((2, 1, 7), (1, 4, 1)), fn, id="both-broadcast")
    case(name, mk((1,), (1,)), fn, id="size1")
    case(name, non_contiguous(mk((5, 3), (5, 3))), fn, id="non-contiguous")
case("div", mk((4, 9), (9,), positive=(1,)), torch.div, id="broadcast")
case("div", mk((2, 3, 1), (1, 1, 5), positive=(1,)), torch.div, id="outer")
UNARY = {"silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": F.relu}
for name, fn in UNARY.items():
    case(name, mk((4, 33)), fn, id="odd")
    case(name, mk((1,)), fn, id="size1")
    case(name, non_contiguous(mk((3, 5, 2))), fn, id="non-contiguous")
case("leaky_relu", mk((4, 33)), lambda x: F.leaky_relu(x, 0.2), negative_slope=0.2)
for approx in ("none", "tanh"):
    case("gelu", mk((4, 33)), lambda x, a=approx: F.gelu(x, approximate=a), id=approx, approximate=approx)
    case("geglu", mk((3, 17), (3, 17)), lambda g, u, a=approx: F.gelu(g, approximate=a) * u, id=approx, approximate=approx)
case("swiglu", mk((3, 17), (3, 17)), lambda g, u: F.silu(g) * u)
case("swiglu", mk((1, 1), (1, 1)), lambda g, u: F.silu(g) * u, id="size1")

# normalization
case("rmsnorm", mk((3, 7), (7,)), lambda x, w: F.rms_norm(x, (7,), w, 1e-6), id="weighted")
case("rmsnorm", mk((2, 1, 64)), lambda x: F.rms_norm(x, (64,), None, 1e-5), id="plain", eps=1e-5)
case("layernorm", mk((3, 10), (10,), (10,)), lambda x, w, b: F.layer_norm(x, (10,), w, b, 1e-5), id="affine")
case("layernorm", mk((2, 5, 1)), lambda x: F.layer_norm(x, (1,), eps=1e-5), id="size1")
case("groupnorm", mk((2, 6, 5, 4), (6,), (6,)), lambda x, w, b: F.group_norm(x, 3, w, b, 1e-5), id="affine", groups=3)
case("groupnorm", mk((1, 4, 7)), lambda x: F.group_norm(x, 2, eps=1e-5), id="1d-plain", groups=2)
case("batchnorm", mk((2, 4, 5, 3), (4,), (4,), (4,), (4,), positive=(2,)),
     lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, False, 0.0, 1e-5), id="affine")


def masked_softmax_ref(causal=False, window=0):
    def ref(x, mask=None):
        sq, sk = x.shape[-2], x.shape[-1]
        q = torch.arange(sq)[:, None] + (sk - sq)
        k = torch.arange(sk)[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            keep &= k <= q
        if window:
            keep &= q - k < window
        x = x if mask is None else x + mask
        return torch.softmax(x.masked_fill(~keep, -math.inf), dim=-1)
    return ref


case("softmax", mk((3, 7)), lambda x: torch.softmax(x, -1), id="rows")
case("softmax", mk((4, 3)), lambda x: torch.softmax(x, 0), id="axis0", axis=0)
case("softmax", mk((2, 3, 5, 5)), masked_softmax_ref(causal=True), id="causal", causal=True)
case("softmax", mk((2, 1, 3, 6), (1, 1, 3, 6)), masked_softmax_ref(causal=True), id="causal-rect-mask", causal=True)
case("softmax", mk((1, 6, 6)), masked_softmax_ref(causal=True, window=3), id="window", causal=True, window=3)

# matmul and attention
case("matmul", mk((3, 8), (8, 5)), torch.matmul, id="plain")
case("matmul", mk((2, 3, 33), (5, 33)), lambda a, b: a @ b.T, id="weight-nk", transpose_b=True)
case("matmul", mk((2, 1, 4, 8), (3, 8, 6)), torch.matmul, id="batch-broadcast")
case("matmul", mk((1, 16), (7, 16)), lambda a, b: a @ b.T, id="gemv", transpose_b=True)
case("matmul", non_contiguous(mk((3, 8), (8, 5))), torch.matmul, id="non-contiguous")
case("matmul", mk((2, 3, 33), (5, 33), (5,)), F.linear, id="bias", transpose_b=True)
for approx, epilogue in (("none", "gelu"), ("tanh", "gelu_tanh")):
    case("matmul", mk((2, 3, 33), (5, 33), (5,)), lambda a, b, c, x=approx: F.gelu(F.linear(a, b, c), approximate=x),
         id=epilogue, transpose_b=True, epilogue=epilogue)


def with_residual(make, residual_shape):
    """A matmul's inputs with a residual stream added (no bias)."""
    return lambda dt: make(dt)[:2] + [None] + mk(residual_shape, seed=3)(dt)


case("matmul", with_residual(mk((1, 64), (7, 64)), (1, 7)), lambda a, b, _, r: a @ b.T + r, id="gemv-residual", transpose_b=True)
case("matmul", with_residual(mk((2, 3, 33), (5, 33)), (2, 3, 5)), lambda a, b, _, r: a @ b.T + r, id="residual",
     transpose_b=True)
def rms_normalized(a, weight, eps=1e-6):
    return a * torch.rsqrt((a * a).mean(-1, keepdim=True) + eps) * weight


def with_norm(make, k, residual_shape=None):
    """A matmul's inputs with the rmsnorm weight of its activations (and a residual stream)."""
    return lambda dt: (make(dt)[:2] + [None] + (mk(residual_shape, seed=3)(dt) if residual_shape else [None])
                       + mk((k,), seed=4, positive=(0,))(dt))


case("matmul", with_norm(mk((1, 64), (7, 64)), 64), lambda a, b, _, r, w: rms_normalized(a, w, 1e-5) @ b.T, id="gemv-norm",
     transpose_b=True, norm_eps=1e-5)
case("matmul", with_norm(mk((2, 3, 33), (5, 33)), 33), lambda a, b, _, r, w: rms_normalized(a, w) @ b.T, id="norm",
     transpose_b=True)
case("matmul", with_norm(mk((1, 64), (7, 64)), 64, (1, 7)), lambda a, b, _, r, w: rms_normalized(a, w) @ b.T + r,
     id="gemv-norm-residual", transpose_b=True)
case("matmul", with_norm(mk((2, 2100), (7, 2100)), 2100, (2, 7)), lambda a, b, _, r, w: rms_normalized(a, w) @ b.T + r,
     id="gemv-norm-residual-long", transpose_b=True)      # K in three steps, the last ragged
case("matmul", lambda dt: mk((1, 8200), (7, 8200))(dt) + [None] + mk((1, 7), seed=3)(dt), lambda a, b, _, r: a @ b.T + r,
     id="gemv-residual-8k", transpose_b=True)            # rows of 8192 or more: the long-row tiles (an 8B's down projection)
case("matmul", with_norm(mk((1, 1500), (9, 1500)), 1500, (1, 9)), lambda a, b, _, r, w: rms_normalized(a, w) @ b.T + r,
     id="gemv-norm-residual-wide", transpose_b=True)     # rows of 1025-2048, few of them: the o projection's tiles
case("matmul", lambda dt: mk((2, 3, 33), (5, 33), (5,), (2, 3, 5))(dt),
     lambda a, b, c, r: F.gelu(F.linear(a, b, c), approximate="tanh") + r, id="bias-gelu-residual", transpose_b=True,
     epilogue="gelu_tanh")


def gated(act, y):
    """A gated epilogue: act over the even columns (gates) times the odd ones (ups)."""
    return act(y[..., 0::2]) * y[..., 1::2]


for epilogue, act in (("swiglu", F.silu), ("geglu_tanh", lambda g: F.gelu(g, approximate="tanh"))):
    case("matmul", mk((2, 3, 33), (10, 33)), lambda a, b, f=act: gated(f, a @ b.T), id=epilogue, transpose_b=True,
         epilogue=epilogue)
    # a ragged last program
    case("matmul", with_norm(mk((1, 64), (10, 64)), 64, (1, 5)),
         lambda a, b, _, r, w, f=act: gated(f, rms_normalized(a, w) @ b.T) + r,
         id=f"gemv-norm-{epilogue}-residual", transpose_b=True, epilogue=epilogue)
case("matmul", with_norm(mk((1, 16), (8192, 16)), 16), lambda a, b, _, r, w: gated(F.silu, rms_normalized(a, w) @ b.T),
     dtypes=("f16",), id="gemv-norm-swiglu-wide", transpose_b=True, epilogue="swiglu")   # 8192+ rows: a gate_up's tiles
case("matmul", mk((2, 3, 33), (10, 33), (10,)), lambda a, b, c: gated(F.silu, F.linear(a, b, c)), id="bias-swiglu",
     transpose_b=True, epilogue="swiglu")


def sdpa_ref(causal=False, scale=None, softcap=0.0, window=0):
    def ref(q, k, v, mask=None):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        probs = masked_softmax_ref(causal, window)(s, mask)
        return probs @ v
    return ref


case("sdpa", mk((1, 4, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8)),
     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), id="causal-gqa", causal=True)
case("sdpa", mk((2, 3, 4, 6), (2, 3, 7, 6), (2, 3, 7, 5), (2, 1, 4, 7)),
     lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), id="mask-dv")
case("sdpa", mk((1, 6, 1, 16), (1, 2, 9, 16), (1, 2, 9, 16)), sdpa_ref(True, 0.3), id="decode-scale", causal=True, scale=0.3)
case("sdpa", mk((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8)), sdpa_ref(True, softcap=2.0, window=2),
     id="softcap-window", causal=True, softcap=2.0, window=2)


def rope_ref(style, rotary):
    def ref(x, positions, inv_freq):
        angle = positions[..., None].float() * inv_freq
        cos, sin = torch.cos(angle)[..., None, :], torch.sin(angle)[..., None, :]
        rot, rest = x[..., :rotary], x[..., rotary:]
        if style == "neox":      # HF rotate_half
            a, b = rot[..., : rotary // 2], rot[..., rotary // 2:]
            out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
        else:                    # GPT-J / ggml "normal" pairs
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
        return torch.cat([out, rest], -1)
    return ref


def rope_inputs(batch, seq, heads, dim, rotary):
    def make(dt):
        x = randn(*batch, seq, heads, dim).astype(NP[dt])
        positions = np.arange(3, 3 + seq, dtype=np.int64)
        if batch:
            positions = positions.reshape((1,) * len(batch) + (seq,)).repeat(batch[0], 0)
        inv_freq = (10000.0 ** (-np.arange(0, rotary, 2, dtype=np.float32) / rotary)).astype(np.float32)
        return [x, positions, inv_freq]
    return make


for style in ("neox", "interleaved"):
    case("rope", rope_inputs((2,), 5, 3, 8, 8), rope_ref(style, 8), id=f"{style}-full", style=style)
    case("rope", rope_inputs((1,), 3, 2, 16, 8), rope_ref(style, 8), id=f"{style}-partial", style=style)
    case("rope", rope_inputs((), 1, 1, 4, 4), rope_ref(style, 4), id=f"{style}-one-token", style=style)


def int_inputs(make_floats, *int_arrays):
    return lambda dt: make_floats(dt) + [np.asarray(a, np.int64) for a in int_arrays]


def ints(*arrays, dtype=np.int32):
    """Integer inputs (the case's float dtype label unused): arithmetic on integers truncates and wraps."""
    return lambda dt: [np.asarray(a, dtype) for a in arrays]


NUMERATORS, DENOMINATORS = [[7, -7, 7, -7, 0, -128], [9, -9, 2, 1, 6, 5]], [3, -3, 2, -4, 5, 7]
case("div", ints(NUMERATORS, DENOMINATORS), lambda a, b: torch.div(a, b, rounding_mode="trunc"), ("f32",), id="int-trunc")
case("div", ints(NUMERATORS, DENOMINATORS, dtype=np.int8), lambda a, b: torch.div(a, b, rounding_mode="trunc"), ("f32",),
     id="int8-smallest")
case("mod", ints(NUMERATORS, DENOMINATORS), torch.remainder, ("f32",), id="int-python")
case("mod", ints(NUMERATORS, DENOMINATORS), torch.fmod, ("f32",), id="int-fmod", fmod=True)
case("mod", mk((4, 6), (6,), positive=(1,)), torch.fmod, id="fmod", fmod=True)
INTEGER_ARITHMETIC = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum, "minimum": torch.minimum}
for name, fn in INTEGER_ARITHMETIC.items():
    case(name, ints(NUMERATORS, DENOMINATORS, dtype=np.int64), fn, ("f32",), id="int")
    case(name, ints([[3 << 40, -(5 << 33) - 1]], [[7, (1 << 33) + 3]], dtype=np.int64), fn, ("f32",), id="int-wide")
case("neg", ints(NUMERATORS), torch.neg, ("f32",), id="int")
case("reduce_sum", ints(NUMERATORS, dtype=np.int64), lambda x: x.sum(-1), ("f32",), id="int")
case("topk", ints([[3, 9, 1, 9, -2]], dtype=np.int64), lambda x: torch.topk(x, 2, -1, sorted=True), ("f32",), id="int", k=2)


case("embedding", int_inputs(mk((10, 6)), [[1, 0, 9], [4, 4, 2]]), lambda t, ids: F.embedding(ids, t), id="2d-ids")
case("embedding", int_inputs(mk((3, 5)), [2]), lambda t, ids: F.embedding(ids, t), id="one")


def kv_append_ref(pages, new, slots):
    flat = pages.reshape(-1, *pages.shape[2:]).clone()
    flat.index_copy_(0, slots.reshape(-1), new.reshape(-1, *pages.shape[2:]))
    return flat.reshape(pages.shape)


case("kv_append", int_inputs(mk((4, 2, 2, 3), (3, 2, 3)), [5, 0, 6]), kv_append_ref)


def rotary_inputs(rows, rotary):
    """A fused rope's inputs: each row's position, and the inverse frequencies of `rotary` dims."""
    return [np.arange(7, 7 + rows, dtype=np.int64), (10000.0 ** (-np.arange(0, rotary, 2) / rotary)).astype(np.float32)]


for style in ("neox", "interleaved"):        # keys rotated as they are stored; 6 of 8 dims rotary (partial)
    case("kv_append", lambda dt: int_inputs(mk((4, 2, 2, 8), (3, 2, 8)), [5, 0, 6])(dt) + rotary_inputs(3, 6),
         lambda p, n, sl, pos, f, st=style: kv_append_ref(p, rope_ref(st, 6)(n, pos, f), sl), id=f"rope-{style}", style=style)
case("kv_append", lambda dt: int_inputs(mk((4, 2, 2, 8), (3, 2, 8)), [5, 0, 6])(dt) + rotary_inputs(3, 6)
     + mk((4, 2, 2, 8), (3, 2, 8), seed=5)(dt),       # a layer's keys (rotated) and values, one kernel
     lambda p, n, sl, pos, f, vp, vn: (kv_append_ref(p, rope_ref("neox", 6)(n, pos, f), sl), kv_append_ref(vp, vn, sl)),
     id="keys-and-values")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_kv_append_rotates_f32_keys_into_an_f16_cache(style, backend):
    """GGUF decode's mix: f32 keys, rotated as they are stored in an f16 cache, land rounded to f16
    (within one f16 step of torch's rounding of its own rotation); untouched slots keep their values."""
    rng = np.random.default_rng(0)
    pages = rng.standard_normal((4, 2, 2, 8)).astype(np.float16)
    new = rng.standard_normal((3, 2, 8)).astype(np.float32)
    slots = np.array([5, 0, 6], np.int64)
    positions, inv_freq = rotary_inputs(3, 6)
    rotated = rope_ref(style, 6)(torch.from_numpy(new), torch.from_numpy(positions), torch.from_numpy(inv_freq))
    want = kv_append_ref(torch.from_numpy(pages.astype(np.float32)), rotated, torch.from_numpy(slots)).half().numpy()
    got = run_op("kv_append", pages.copy(), new, slots, positions, inv_freq, backend=backend, style=style)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3, atol=1e-3)


case("kv_read", int_inputs(mk((4, 2, 2, 3)), [[5, 0, 6], [1, 2, 3]]),
     lambda p, s: p.reshape(-1, *p.shape[2:])[s])


def q8_0_read(pages, slots):
    """kv_read of a q8_0 cache: each 34-byte block an f16 scale times its 32 signed bytes."""
    blocks = pages.reshape(-1, *pages.shape[2:])[slots].reshape(*slots.shape, pages.shape[2], -1, 34)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    return (blocks[..., 2:].contiguous().view(torch.int8).float() * scale).flatten(-2)


case("kv_read", lambda dt: [kv.encode("q8_0", randn(8, 64)).reshape(2, 2, 2, 68), np.array([[3, 0], [-1, 2]], np.int64)],
     q8_0_read, ("f32",), id="q8_0", codec="q8_0")



def paged_attention_inputs(rows, heads, kv_heads, dim, slots, seed=0):
    """q [rows, H, D], pages [4, 4, KV, D] (16 slots), ctx_slots in scrambled page order, and a causal
    mask over the context whose last column is padding (-inf)."""
    def make(dt):
        q, k_pages, v_pages = mk((rows, heads, dim), (4, 4, kv_heads, dim), (4, 4, kv_heads, dim), seed=seed)(dt)
        length = len(slots)
        visible = np.arange(length)[None, :] <= np.arange(length - 1 - rows, length - 1)[:, None]
        mask = np.where(visible, 0, -np.inf).astype(NP[dt])[None, None]
        return [q, k_pages, v_pages, np.asarray(slots, np.int64), mask]
    return make


def paged_attention_ref(scale=None, softcap=0.0):
    def ref(q, k_pages, v_pages, slots, mask):
        keys, values = (p.reshape(-1, *p.shape[2:])[slots].transpose(0, 1)[None] for p in (k_pages, v_pages))
        out = sdpa_ref(scale=scale, softcap=softcap)(q.transpose(0, 1)[None], keys, values, mask)
        return out[0].transpose(0, 1)
    return ref


def segmented_attention_inputs(dt):
    """Two decode rows of a batch, each seeing only its own sequence's segment of a 300-slot context
    (as the engine lays a batch out): most context tiles are hidden from each row entirely."""
    q, k_pages, v_pages = mk((2, 4, 16), (20, 16, 2, 16), (20, 16, 2, 16))(dt)
    slots = np.random.default_rng(1).permutation(np.arange(1, 320))[:300]
    mask = np.full((1, 1, 2, 300), -np.inf, NP[dt])
    mask[0, 0, 0, :100] = 0
    mask[0, 0, 1, 128:290] = 0
    spans = np.array([[10, 128], [128, 300]], np.int64)      # row 0's span also hides 10 of its visible keys
    return [q, k_pages, v_pages, slots.astype(np.int64), mask, spans]


def spanned_attention_ref(q, k_pages, v_pages, slots, mask, spans):
    column = torch.arange(mask.shape[-1])[None, :]
    inside = (spans[:, :1] <= column) & (column < spans[:, 1:])
    return paged_attention_ref()(q, k_pages, v_pages, slots, mask.masked_fill(~inside, -torch.inf))


def long_decode_inputs(heads=16, kv_heads=2, dim=128):
    """One decode row over 600 cached slots (by default eight query heads per kv head, 128-wide): a kernel
    that splits the context in shares merges many of them, more than it holds at once."""
    def make(dt):
        q, k_pages, v_pages = mk((1, heads, dim), (40, 16, kv_heads, dim), (40, 16, kv_heads, dim), seed=3)(dt)
        slots = np.random.default_rng(4).permutation(640)[:600].astype(np.int64)
        return [q, k_pages, v_pages, slots, np.zeros((1, 1, 1, 600), NP[dt])]
    return make


CONTEXT = [9, 10, 11, 12, 0, 1, 2, 3, 14, 4, 5]
case("paged_attention", paged_attention_inputs(1, 4, 2, 8, CONTEXT), paged_attention_ref(), id="decode-gqa")
case("paged_attention", paged_attention_inputs(3, 3, 1, 16, CONTEXT), paged_attention_ref(0.2, 1.5),
     id="rows-scale-softcap", scale=0.2, softcap=1.5)
case("paged_attention", paged_attention_inputs(10, 2, 2, 8, CONTEXT), paged_attention_ref(), id="prefill")
case("paged_attention", segmented_attention_inputs, spanned_attention_ref, id="batch-spans")
case("paged_attention", lambda dt: [*segmented_attention_inputs(dt)[:4], None, np.array([[10, 60], [200, 290]], np.int64)],
     lambda q, k, v, sl, _, spans: spanned_attention_ref(q, k, v, sl, torch.zeros((1, 1, 2, 300)), spans), id="spans-unmasked")
case("paged_attention", long_decode_inputs(), paged_attention_ref(), id="long-decode")


def shared_context_inputs(dt):
    """Five rows (beams) all reading the same 600 contiguous slots, unmasked: an encoder's cross-attention
    keys, which a CPU kernel reads in place with BLAS."""
    q, k_pages, v_pages = mk((5, 4, 16), (40, 16, 2, 16), (40, 16, 2, 16), seed=5)(dt)
    return [q, k_pages, v_pages, np.arange(16, 616, dtype=np.int64), None, np.tile(np.array([0, 600], np.int64), (5, 1))]


case("paged_attention", shared_context_inputs,
     lambda q, k, v, sl, _, spans: spanned_attention_ref(q, k, v, sl, torch.zeros((1, 1, 5, 600)), spans), id="shared-context")
# the decode launches of real heads, for the sm_90 check: Llama-3.2-1B's and -8B's (GQA), Gemma-2B's (MQA, 256 wide)
for heads, kv_heads, dim in ((32, 8, 64), (32, 8, 128), (8, 1, 256)):
    case("paged_attention", long_decode_inputs(heads, kv_heads, dim), paged_attention_ref(),
         id=f"long-decode-{heads}x{kv_heads}x{dim}")
# queries rotated as they are loaded: 6 of 8 dims rotary (partial), and all 16 (as real heads)
for style, (dim, rotary, whole) in itertools.product(("neox", "interleaved"), ((8, 6, ""), (16, 16, "-whole"))):
    case("paged_attention",
         lambda dt, d=dim, n=rotary: paged_attention_inputs(3, 4, 2, d, CONTEXT)(dt) + [None] + rotary_inputs(3, n),
         lambda q, k, v, sl, m, _, pos, f, st=style, n=rotary: paged_attention_ref()(rope_ref(st, n)(q, pos, f), k, v, sl, m),
         id=f"rope-{style}{whole}", rope_style=style)

def copies_attention_inputs(rows, kinds, context=40, heads=4, kv_heads=2, dim=64, first=0, copies=np.float16, seed=6):
    """A sequence's `context` positions coded in compressed pages (`kinds`: the keys' and values' codecs) at
    scrambled slots, float copies of about two in three of them (the rest -1: none), and the causal spans
    of its last `rows` positions, from `first` on (a sliding window's)."""
    def make(dt):
        rng = np.random.default_rng(seed)
        q = randn(rows, heads, dim, rng=rng)
        keys, values = randn(context, kv_heads, dim, rng=rng), randn(context, kv_heads, dim, rng=rng)
        slots = rng.permutation(np.arange(16, 16 + context))
        copy_slots = np.where(rng.random(context) < 0.7, rng.permutation(np.arange(16, 16 + context)), -1)
        pages, kept = [], []
        for kind, rows_of in zip(kinds, (keys, values)):
            data = np.zeros((context // 16 + 2, 16, kv_heads, kv.CODECS[kind].row_bytes(dim)), np.uint8)
            data.reshape(-1, kv_heads, data.shape[-1])[slots] = kv.encode(kind, rows_of)
            pages.append(data)
            floats = np.zeros((context // 16 + 2, 16, kv_heads, dim), copies)
            floats.reshape(-1, kv_heads, dim)[copy_slots[copy_slots >= 0]] = rows_of[copy_slots >= 0]
            kept.append(floats)
        spans = np.array([[first, context - rows + 1 + r] for r in range(rows)], np.int64)
        return [q.astype(NP[dt]), *pages, slots.astype(np.int64), spans, *kept, copy_slots.astype(np.int64)]
    return make


def copies_attention_ref(kinds, sinks, window, scale=None, softcap=0.0):
    """Row s reads position t's float copy where it has one and t is among its span's first `sinks` or last
    `window` positions, the codes' dequantized values (quant/kv.py, checked against llama.cpp's and the
    paper's in tests/engine) elsewhere."""
    def ref(q, k_pages, v_pages, slots, spans, k_copies, v_copies, copy_slots):
        coded = [torch.from_numpy(kv.decode(kind, p.reshape(-1, *p.shape[2:])[slots].numpy())) for kind, p in
                 zip(kinds, (k_pages, v_pages))]
        kept = [c.reshape(-1, *c.shape[2:])[copy_slots.clamp(min=0)] for c in (k_copies, v_copies)]
        t = torch.arange(len(slots))[None, :]
        lo, hi = spans[:, :1], spans[:, 1:]
        use = (copy_slots >= 0)[None, :] & ((t < lo + sinks) | (t >= hi - window))          # [S, T]
        group = q.shape[1] // k_pages.shape[2]
        keys, values = (torch.where(use[:, :, None, None], f[None], c[None]).repeat_interleave(group, 2)
                        for f, c in zip(kept, coded))
        scores = torch.einsum("shd,sthd->sht", q, keys) * (1 / math.sqrt(q.shape[2]) if scale is None else scale)
        scores = softcap * torch.tanh(scores / softcap) if softcap else scores
        scores = scores.masked_fill(~((lo <= t) & (t < hi))[:, None, :], -torch.inf)
        return torch.einsum("sht,sthd->shd", torch.softmax(scores, -1), values)
    return ref


# a compressed cache's sinks and window read from their float copies: decode and prefill rows, rotated ggml and
# tq codes, f32 copies, scale and softcap, and a long decode over a sliding window (a kernel's shares begin
# past the span's start, which the sinks are counted from)
for rows, kinds, (sinks, window), extra, attrs, name in (
        (3, ("tq4", "tq4"), (4, 8), {}, {}, "decode-tq4"),
        (24, ("tq4", "tq3"), (4, 8), {}, {"scale": 0.2, "softcap": 30.0}, "prefill-tq4-tq3-softcap"),
        (5, ("q8_0", "q4_0"), (2, 8), {"copies": np.float32}, {}, "rows-q8_0-q4_0-f32-copies"),
        (1, ("tq4", "tq2"), (4, 32), {"context": 600, "heads": 16, "dim": 128, "first": 100}, {}, "long-decode-window")):
    case("paged_attention_copies", copies_attention_inputs(rows, kinds, **extra),
         copies_attention_ref(kinds, sinks, window, **attrs), dtypes=("f32",), id=name, k_codec=kinds[0], v_codec=kinds[1],
         sinks=sinks, window=window, **attrs)


# primitive ops: one per atom mode
PRIMITIVE = {"exp": torch.exp, "erf": torch.erf, "sin": torch.sin, "cos": torch.cos, "floor": torch.floor, "ceil": torch.ceil,
             "round": torch.round, "neg": torch.neg, "abs": torch.abs, "atan": torch.atan}
for name, fn in PRIMITIVE.items():
    case(name, mk((4, 33)), fn)
for name, fn in {"log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal}.items():
    case(name, mk((4, 33), positive=(0,)), fn)
case("round", lambda dt: [np.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.49], NP[dt])], torch.round, id="ties-to-even")
case("atan", lambda dt: [np.array([0.0, 1.0, -1.0, 0.999, 1.001, 40.0, -1e4, np.inf, -np.inf, 1e-6], NP[dt])], torch.atan,
     id="edges")
case("pow", mk((3, 5), (3, 5), positive=(0,)), torch.pow)
case("pow", lambda dt: [randn(3, 4).astype(NP[dt]), np.array([[0.0, 1.0, 2.0, 3.0]], NP[dt])], torch.pow, id="whole-exponents")
case("minimum", mk((3, 5), (5,)), torch.minimum)
case("maximum", mk((2, 1, 5), (3, 1)), torch.maximum)
case("clip", mk((4, 9)), lambda x: torch.clamp(x, -0.5, 0.3), min=-0.5, max=0.3)
case("clip", mk((4, 9)), lambda x: torch.clamp(x, min=-0.2), id="low-only", min=-0.2)
COMPARISONS = {"less": torch.lt, "less_equal": torch.le, "greater": torch.gt, "greater_equal": torch.ge, "equal": torch.eq}
for name, fn in COMPARISONS.items():
    case(name, lambda dt: [np.round(x * 2) for x in mk((3, 5), (5,))(dt)], fn)
    case(name, lambda dt: [np.array([[1, 5, 3]], np.int64), np.array([[2], [3]], np.int64)], fn, id="int", dtypes=("f32",))
LOGIC = {"logical_and": torch.logical_and, "logical_or": torch.logical_or}
for name, fn in LOGIC.items():
    case(name, lambda dt: [randn(3, 4) > 0, randn(4, rng=np.random.default_rng(1)) > 0], fn, dtypes=("f32",))
case("logical_not", lambda dt: [randn(3, 4) > 0], torch.logical_not, dtypes=("f32",))
REDUCTIONS = {"reduce_sum": torch.sum, "reduce_mean": torch.mean, "reduce_max": torch.amax, "reduce_min": torch.amin}
for name, fn in REDUCTIONS.items():
    case(name, mk((3, 4, 5)), lambda x, f=fn: f(x, dim=-1), id="last")
    case(name, mk((3, 4, 5)), lambda x, f=fn: f(x, dim=(0, 2), keepdim=True), id="axes-keepdims", axes=(0, 2), keepdims=True)
    case(name, mk((3, 70)), lambda x, f=fn: f(x, dim=(0, 1)), id="all", axes=None)
case("reduce_prod", mk((3, 4, 5)), lambda x: x.prod(-1), id="last")
case("reduce_prod", mk((3, 4, 5)), lambda x: x.prod(2, keepdim=True).prod(0, keepdim=True), id="axes-keepdims", axes=(0, 2),
     keepdims=True)
case("take", int_inputs(mk((3, 5, 2)), [[4, 0], [-1, 2]]),
     lambda x, i: x.index_select(1, i.reshape(-1) % 5).reshape(3, 2, 2, 2), axis=1)
case("scatter", lambda dt: [mk((5, 3))(dt)[0], np.array([3, 0], np.int64), mk((2, 3), seed=1)(dt)[0]],
     lambda x, i, u: x.index_copy(0, i, u), axis=0)
for reduction, torch_name in (("add", None), ("mul", "prod"), ("max", "amax"), ("min", "amin")):
    case("scatter_reduce", lambda dt: [mk((3, 5))(dt)[0], np.array([4, 0, 4, -1], np.int64), mk((3, 4), seed=1)(dt)[0]],
         lambda x, i, u, r=torch_name: x.index_reduce(1, i % 5, u, r) if r else x.index_add(1, i % 5, u), id=reduction,
         axis=1, reduction=reduction)
case("scatter_reduce", lambda dt: [np.arange(6, dtype=np.int64).reshape(3, 2), np.array([2, 2], np.int64),
                                   np.array([[5, -1], [2, 7]], np.int64)],
     lambda x, i, u: x.index_reduce(0, i, u, "amax"), ("f32",), id="int-max", axis=0, reduction="max")
case("expand", mk((3, 1)), lambda x: x.expand(2, 3, 4), shape=(2, 3, 4))
case("expand", mk((2, 3)), lambda x: x.expand(4, 2, 3), id="ones-keep", shape=(4, 1, 1))
case("take", lambda dt: [np.arange(15, dtype=np.int64).reshape(5, 3), np.array([[4, -5]], np.int64)],
     lambda x, i: x[i % 5], ("f32",), id="int-rows")
case("pad", mk((2, 3, 4)), lambda x: F.pad(x, (2, 1, 1, 2), value=0.5), id="constant", pads=((0, 0), (1, 2), (2, 1)), value=0.5)
case("pad", mk((2, 3, 4)), lambda x: F.pad(x, (2, 1, 1, 2), mode="reflect"), id="reflect", pads=((0, 0), (1, 2), (2, 1)),
     mode="reflect")
case("pad", mk((2, 3, 4)), lambda x: F.pad(x, (3, 1, 0, 2), mode="replicate"), id="edge", pads=((0, 0), (0, 2), (3, 1)),
     mode="edge")
case("cumsum", mk((3, 7)), lambda x: torch.cumsum(x, 1), axis=1)
case("cumsum", mk((5, 2, 3)), lambda x: torch.cumsum(x, 0), id="axis0", axis=0)
case("cumprod", mk((3, 7)), lambda x: torch.cumprod(x, 1), axis=1)
case("cumprod", ints([[2, -1, 3, 0, 5]], dtype=np.int64), lambda x: torch.cumprod(x, 1), ("f32",), id="int", axis=1)
case("tile", mk((2, 3)), lambda x: torch.tile(x, (2, 3)), repeats=(2, 3))
case("range", lambda dt: [np.array(2, np.int64), np.array(11, np.int64), np.array(3, np.int64)],
     lambda a, b, c: torch.arange(int(a), int(b), int(c)), id="int", dtypes=("f32",))
case("range", lambda dt: [np.array(0.5, np.float32), np.array(2.0, np.float32), np.array(0.4, np.float32)],
     lambda a, b, c: torch.arange(float(a), float(b), float(c), dtype=torch.float32), id="float", dtypes=("f32",))
case("range", lambda dt: [np.array(5, np.int64), np.array(1, np.int64), np.array(-2, np.int64)],
     lambda a, b, c: torch.arange(int(a), int(b), int(c)), id="down", dtypes=("f32",))
case("nonzero", lambda dt: [np.round(randn(3, 4, 5)).astype(NP[dt])], lambda x: torch.nonzero(x).T)


def greedy_nms(boxes, scores, most, iou, threshold, center):
    """torch, box by box: per batch and class, in order of score, a box is kept unless one kept before it
    overlaps it by more than iou (corners as ONNX reads them), at most `most` a class."""
    if center:
        x, y, w, h = boxes.unbind(-1)
        boxes = torch.stack([y - h / 2, x - w / 2, y + h / 2, x + w / 2], -1)
    lo, hi = torch.minimum(boxes[..., :2], boxes[..., 2:]), torch.maximum(boxes[..., :2], boxes[..., 2:])
    rows = []
    for b, c in itertools.product(range(scores.shape[0]), range(scores.shape[1])):
        kept = []
        for i in torch.sort(-scores[b, c], stable=True).indices.tolist():
            if len(kept) == most or threshold is not None and not scores[b, c, i] > threshold:
                continue
            inter = (torch.minimum(hi[b, i], hi[b, kept]) - torch.maximum(lo[b, i], lo[b, kept])).clamp(min=0).prod(-1)
            union = (hi[b, i] - lo[b, i]).prod() + (hi[b, kept] - lo[b, kept]).prod(-1) - inter
            if not (inter / union > iou).any():
                kept.append(i)
                rows.append((b, c, i))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def boxes_and_scores(center):
    def make(dt):
        rng = np.random.default_rng(3)
        boxes = (rng.random((2, 40, 4)) * 10).astype(NP[dt])
        if center:
            boxes[..., 2:] = rng.random((2, 40, 2)) * 4 + 0.5
        return [boxes, rng.random((2, 3, 40)).astype(NP[dt])]
    return make


for centered in (False, True):
    for most, threshold in ((40, None), (4, 0.3)):
        case("non_max_suppression", boxes_and_scores(centered),
             lambda b, s, most=most, threshold=threshold, centered=centered: greedy_nms(b.float(), s.float(), most, 0.4,
                                                                                       threshold, centered),
             id=f"{'center' if centered else 'corners'}-{most}-{threshold}", most=most, iou=0.4, threshold=threshold,
             center=centered)

# layout and indexing
case("reshape", mk((2, 3, 4)), lambda x: x.reshape(6, -1), shape=(6, -1))
case("transpose", non_contiguous(mk((2, 3, 4))), lambda x: x.transpose(0, 2), dim0=0, dim1=2)
case("permute", mk((2, 3, 4)), lambda x: x.permute(2, 0, 1), perm=(2, 0, 1))
case("concat", mk((2, 3), (2, 1), (2, 4)), lambda *xs: torch.cat(xs, 1), axis=1)
case("concat", mk((1, 3)), lambda *xs: torch.cat(xs, 0), id="single", axis=0)
case("split", mk((4, 9)), lambda x: torch.split(x, [2, 3, 4], dim=1), sizes=(2, 3, 4), axis=1)
case("split", non_contiguous(mk((6, 3))), lambda x: torch.split(x, [1, 5], dim=0), id="non-contiguous", sizes=(1, 5), axis=0)
case("where", lambda dt: [randn(3, 4) > 0] + mk((3, 4), (1, 4), seed=1)(dt), torch.where, id="broadcast")
case("where", lambda dt: [randn(3, 4) > 0, np.arange(12, dtype=np.int64).reshape(3, 4), np.array([-(1 << 40)], np.int64)],
     torch.where, ("f32",), id="int")
case("slice", mk((5, 9)), lambda x: x[:, 1:8:3], axis=-1, start=1, stop=8, step=3)
case("gather", int_inputs(mk((3, 4)), [[0, 3], [1, 1], [2, 0]]), lambda x, i: torch.gather(x, 1, i), axis=1)
case("cast", mk((3, 5)), lambda x: x.half().float(), id="to-f16", dtypes=("f32",), dtype="f16")
case("cast", lambda dt: [randn(3, 5) * 3], lambda x: x.to(torch.int64), id="to-i64", dtypes=("f32",), dtype="i64")
case("cast", lambda dt: [np.arange(-6, 6).reshape(3, 4)], lambda x: x.float(), id="from-i64", dtypes=("f32",), dtype="f32")
case("cast", lambda dt: [np.arange(12).reshape(3, 4) % 3 == 0], lambda x: x.float(), id="from-bool", dtypes=("f32",),
     dtype="f32")
case("argmax", mk((4, 7)), lambda x: torch.argmax(x, -1), dtypes=("f32",))
case("argmax", mk((4, 7)), lambda x: torch.argmax(x, 0), id="axis0", dtypes=("f32",), axis=0)
case("argmax", lambda dt: [np.array([[1, 3, 3, 0], [2, 2, 2, 2], [-np.inf, -np.inf, -1, -1]], NP[dt])],
     lambda x: torch.argmax(x, -1), id="ties-first", dtypes=("f32",))


def wide_ties(dt):
    """Rows of 10000 whose maximum appears twice, in different parts of a parallel reduction."""
    x = randn(2, 10000).astype(NP[dt])
    x[0, [5000, 9000]] = x[1, [100, 4100]] = 10
    return [x]


case("argmax", wide_ties, lambda x: torch.argmax(x, -1), id="wide-ties", dtypes=("f32",))
case("topk", mk((3, 11)), lambda x: torch.topk(x, 4, -1), dtypes=("f32",), k=4)
case("topk", mk((6, 2)), lambda x: torch.topk(x, 6, 0), id="all-axis0", dtypes=("f32",), k=6, axis=0)


def torch_sample(logits, params, width):
    """The sampling pipeline in torch, row by row, the way llama.cpp's samplers and numpy's
    Generator.choice define it: temperature, top-k, top-p, min-p, then u against the cumulative sum."""
    out = []
    for x, (t, k, p, min_p, u) in zip(logits.double(), params.double()):
        if t == 0:
            out.append(int(torch.argmax(x)))
            continue
        x = x / t
        ids = torch.nonzero(x >= torch.topk(x, int(k) if 1 <= k <= width else width).values[-1]).flatten()
        y = x[ids]
        order = torch.argsort(-y, stable=True)
        before = torch.cumsum(torch.softmax(y, 0)[order], 0) - torch.softmax(y, 0)[order]
        keep = torch.zeros_like(y, dtype=torch.bool)
        keep[order[(before < p) | (p >= 1)]] = True
        probs = torch.softmax(torch.where(keep, y, -torch.inf), 0)
        weights = torch.where(probs >= min_p * probs.max(), probs, 0)
        cdf = torch.cumsum(weights, 0)
        out.append(int(ids[torch.searchsorted(cdf / cdf[-1], u, right=True)]))
    return torch.tensor(out)


def sampling_rows(vocab, rows=8, seed=0):
    """Logits [rows, vocab] and param rows (temperature, top_k, top_p, min_p, u) over the pipeline's
    corners: greedy, top-k 1 and beyond the width, top-p and min-p on and off, u near 1."""
    rng = np.random.default_rng(seed)
    settings = [(0, 40, 0.95, 0.05), (0.8, 40, 0.95, 0.05), (0.7, 1, 1.0, 0.0), (1.5, 0, 1.0, 0.0), (1.0, 5, 0.6, 0.0),
                (2.0, 64, 1.0, 0.2), (0.5, 200, 0.9, 0.0), (1.0, 3, 1.0, 0.0)]
    params = np.array([(*s, u) for s in settings[:rows] for u in (rng.random(), 0.999)], np.float32)
    return lambda dt: [(3 * randn(len(params), vocab, rng=rng)).astype(NP[dt]), params]


case("sample", sampling_rows(300), lambda x, p: torch_sample(x, p, 16), dtypes=("f32",), width=16)
case("sample", sampling_rows(1000, rows=3, seed=1), lambda x, p: torch_sample(x, p, 64), id="parts", dtypes=("f32",), width=64)

# convolution, pooling, resampling
case("conv1d", mk((2, 4, 9), (6, 2, 3), (6,)), lambda x, w, b: F.conv1d(x, w, b, 2, 1, 2, 2), id="groups-stride-dilation",
     stride=2, padding=1, dilation=2, groups=2)
case("conv1d", mk((1, 3, 5), (2, 3, 5)), lambda x, w: F.conv1d(x, w), id="full-kernel")
case("conv1d", mk((2, 4, 1100), (6, 2, 3), (6,)), lambda x, w, b: F.conv1d(x, w, b, 2, 4, 3, 2), id="long-groups-stride",
     stride=2, padding=4, dilation=3, groups=2)
case("conv2d", mk((1, 3, 7, 6), (4, 3, 3, 2), (4,)), lambda x, w, b: F.conv2d(x, w, b, (2, 1), (1, 0)),
     id="stride-pad", stride=(2, 1), padding=(1, 0))
case("conv2d", mk((2, 3, 5, 5), (3, 1, 3, 3)), lambda x, w: F.conv2d(x, w, None, 1, 1, 1, 3), id="depthwise",
     padding=1, groups=3)
case("conv2d", mk((2, 6, 9, 8), (12, 1, 3, 3), (12,)), lambda x, w, b: F.conv2d(x, w, b, 2, 1, 1, 6),
     id="depthwise-multiplier-stride", stride=2, padding=1, groups=6)
case("conv2d", mk((1, 4, 11, 10), (4, 1, 5, 3)), lambda x, w: F.conv2d(x, w, None, (1, 2), (2, 1), (2, 1), 4),
     id="depthwise-dilation-stride", stride=(1, 2), padding=(2, 1), dilation=(2, 1), groups=4)
case("conv2d", mk((2, 8, 6, 7), (8, 2, 2, 2), (8,)), lambda x, w, b: F.conv2d(x, w, b, 1, 1, 2, 4),
     id="grouped-direct", padding=1, dilation=2, groups=4)
case("conv2d", mk((2, 16, 9, 9), (8, 4, 3, 3), (8,)), lambda x, w, b: F.conv2d(x, w, b, 3, 2, 1, 4),
     id="grouped-gemm", stride=3, padding=2, groups=4)
case("conv2d", mk((2, 24, 5, 6), (10, 24, 1, 1), (10,)), lambda x, w, b: F.conv2d(x, w, b), id="pointwise")
case("conv2d", mk((2, 64, 7, 6), (64, 64, 3, 3), (64,), (2, 64, 7, 6)), lambda x, w, b, r: F.relu(F.conv2d(x, w, b, 1, 1) + r),
     id="winograd-odd-residual-relu", padding=1, epilogue="relu")
case("conv2d", mk((1, 64, 6, 9), (72, 64, 3, 3)), lambda x, w: F.conv2d(x, w, None, 1, 2), id="winograd-pad-2", padding=2)
case("conv2d", mk((1, 64, 5, 4), (64, 64, 3, 3), (64,)), lambda x, w, b: F.conv2d(x, w, b), id="winograd-no-pad")
case("conv1d", mk((2, 6, 40), (6, 1, 5)), lambda x, w: F.conv1d(x, w, None, 2, 2, 1, 6), id="depthwise",
     stride=2, padding=2, groups=6)
for _epilogue, _act in {"relu": F.relu, "relu6": F.relu6, "silu": F.silu}.items():
    case("conv2d", mk((2, 8, 7, 6), (5, 8, 3, 3), (5,), (2, 5, 7, 6)),
         lambda x, w, b, r, act=_act: act(F.conv2d(x, w, b, 1, 1) + r), id=f"residual-{_epilogue}", padding=1,
         epilogue=_epilogue)
    case("conv2d", mk((1, 4, 8, 8), (4, 1, 3, 3)), lambda x, w, act=_act: act(F.conv2d(x, w, None, 2, 1, 1, 4)),
         id=f"depthwise-{_epilogue}", stride=2, padding=1, groups=4, epilogue=_epilogue)
case("conv2d", lambda dt: [*mk((1, 3, 6, 6), (4, 3, 1, 1), (1, 4, 6, 6))(dt)[:2], None, mk((1, 4, 6, 6), seed=1)(dt)[0]],
     lambda x, w, b, r: F.conv2d(x, w) + r, id="residual-no-bias")
case("conv1d", mk((2, 4, 1100), (6, 4, 3), (6,), (2, 6, 1100)), lambda x, w, b, r: F.silu(F.conv1d(x, w, b, 1, 1) + r),
     id="long-residual-silu", padding=1, epilogue="silu")
case("conv_transpose1d", mk((2, 4, 9), (4, 3, 8), (6,)),
     lambda x, w, b: F.conv_transpose1d(x, w, b, 4, 2, 1, 2), id="groups-stride-pad-extra", stride=4, groups=2,
     crop=((2, 1),))
case("conv_transpose1d", mk((1, 3, 5), (3, 2, 3)), lambda x, w: F.conv_transpose1d(x, w, None, 1, 0, 0, 1, 2), id="dilation",
     dilation=2)
case("conv_transpose2d", mk((1, 3, 4, 5), (3, 2, 3, 2), (2,)),
     lambda x, w, b: F.conv_transpose2d(x, w, b, (2, 3), (1, 0), (1, 2)), id="stride-pad-extra", stride=(2, 3),
     crop=((1, 0), (0, -2)))
case("conv_transpose3d", mk((1, 2, 3, 2, 3), (2, 4, 2, 3, 2), (4,)),
     lambda x, w, b: F.conv_transpose3d(x, w, b, (1, 2, 2), (0, 1, 0)), id="stride-pad", stride=(1, 2, 2),
     crop=((0, 0), (1, 1), (0, 0)))
case("max_pool", mk((1, 2, 7, 6)), lambda x: F.max_pool2d(x, (3, 2), (2, 2), (1, 0)), kernel=(3, 2), stride=(2, 2),
     padding=(1, 0))
case("max_pool", mk((2, 3, 8)), lambda x: F.max_pool1d(x, 3), id="1d", kernel=(3,))
case("max_pool", mk((1, 3, 9, 9)), lambda x: F.max_pool2d(x, 3, 2, 1), id="resnet-stem", kernel=(3, 3), stride=(2, 2),
     padding=(1, 1))
case("avg_pool", mk((2, 3, 9)), lambda x: F.avg_pool1d(x, 3, 2, 1), id="1d", kernel=(3,), stride=(2,), padding=(1,))
case("avg_pool", mk((1, 2, 7, 6)), lambda x: F.avg_pool2d(x, (3, 2), (2, 2), (1, 0)), kernel=(3, 2), stride=(2, 2),
     padding=(1, 0))
case("interpolate", mk((1, 2, 4, 5)), lambda x: F.interpolate(x, (8, 7), mode="nearest"), id="nearest", size=(8, 7))
for align in (False, True):
    case("interpolate", mk((1, 2, 4, 5)), lambda x, a=align: F.interpolate(x, (7, 9), mode="bilinear", align_corners=a),
         id=f"bilinear-align{align}", size=(7, 9), mode="bilinear", align_corners=align)



def torch_router(top_k, scoring="softmax", normalize=False):
    def ref(logits, bias=None):
        scores = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
        index = torch.topk(scores if bias is None else scores + bias, top_k, -1).indices
        weights = torch.gather(scores, -1, index)
        return (weights / weights.sum(-1, keepdim=True) if normalize else weights), index
    return ref


case("router", mk((5, 8)), torch_router(2), top_k=2)
case("router", mk((5, 8)), torch_router(3, normalize=True), id="normalized", top_k=3, normalize=True)
case("router", lambda dt: mk((6, 4))(dt) + [np.array([0.0, 2.0, -1.0, 0.5], np.float32)], torch_router(2, "sigmoid"),
     dtypes=("f32",), id="sigmoid-bias", top_k=2, scoring="sigmoid")


def routed(tokens, experts, k, hidden, ffn, seed=0):
    """moe_ffn inputs: x, each token's k weights and distinct experts, gate/up/down experts."""
    def make(dt):
        rng = np.random.default_rng(seed)
        x, gate, up = randn(tokens, hidden, rng=rng), randn(experts, ffn, hidden, rng=rng), randn(experts, ffn, hidden, rng=rng)
        down = randn(experts, hidden, ffn, rng=rng)
        chosen = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int64)
        weights = rng.random((tokens, k)).astype(np.float32)
        return [x.astype(NP[dt]), weights.astype(NP[dt]), chosen] + [w.astype(NP[dt]) * 0.3 for w in (gate, up, down)]
    return make


def torch_moe_ffn(x, weights, experts, gate, up, down):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            out[t] += w * (down[e] @ (F.silu(gate[e] @ x[t]) * (up[e] @ x[t])))
    return out


case("moe_ffn", routed(6, 4, 2, 8, 5), torch_moe_ffn)
case("moe_ffn", routed(1, 8, 3, 16, 12, seed=1), torch_moe_ffn, id="one-token")


def adapted(rows, adapters, rank, inputs, outputs, index, seed=0, dora=False, folded=False):
    """lora_apply inputs: a product y, its input x, stacked adapter factors, each row's adapter (-1: none) and
    scale, and with `dora` each adapter's magnitude per output; `folded` adds a residual and a norm weight."""
    def make(dt):
        rng = np.random.default_rng(seed)
        y, x = randn(rows, outputs, rng=rng), randn(rows, inputs, rng=rng)
        a, b = randn(adapters, rank, inputs, rng=rng), randn(adapters, outputs, rank, rng=rng)
        scale = rng.random(rows).astype(np.float32) + 0.5
        magnitude = rng.random((adapters, outputs)).astype(np.float32) + 0.5 if dora or folded else None
        folds = [randn(rows, outputs, rng=rng).astype(NP[dt]), rng.random(inputs).astype(NP[dt]) + 0.5] if folded else []
        return [y.astype(NP[dt]), x.astype(NP[dt]), a.astype(NP[dt]), b.astype(NP[dt]), np.asarray(index, np.int64), scale,
                *([magnitude] if magnitude is not None else []), *folds]
    return make


def torch_lora_apply(y, x, a, b, index, scale, magnitude=None, residual=None, norm=None):
    if norm is not None:
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm
    out = y.clone()
    for s, i in enumerate(index.tolist()):
        if i >= 0:
            out[s] += scale[s] * ((x[s] @ a[i].T) @ b[i].T)
            out[s] *= 1 if magnitude is None else magnitude[i]
    return out if residual is None else out + residual


case("lora_apply", adapted(5, 3, 4, 8, 6, [0, -1, 2, 0, 1]), torch_lora_apply)
case("lora_apply", adapted(3, 2, 2, 5, 7, [-1, -1, -1], seed=1), torch_lora_apply, id="no-adapter")
case("lora_apply", adapted(4, 2, 3, 6, 5, [1, -1, 0, 1], seed=2, dora=True), torch_lora_apply, id="dora")
case("lora_apply", adapted(4, 3, 2, 8, 6, [2, -1, 0, 2], seed=3, folded=True), torch_lora_apply, id="norm-residual")
case("lora_apply", adapted(40, 3, 4, 8, 6, [i % 4 - 1 for i in range(40)], seed=4, folded=True), torch_lora_apply,
     id="many-rows")


# a chain of elementwise ops (passes/chains.py makes it of f32 ops only; the CPU compiles it, other backends
# run its atoms)
GELU_TANH = '[["mul",[0,0],{}],["mul",[2,0],{}],["mul",[3,1],{}],["add",[0,4],{}],["tanh",[5],{}],["mul",[6,0],{}]]'
case("chain", mk((3, 7), (1,)), lambda x, c: torch.tanh(x + x * x * x * c) * x, dtypes=("f32",),
     steps=GELU_TANH)
case("chain", mk((2, 5, 4), (5, 1)), lambda x, y: torch.sigmoid(x - y), id="broadcast", dtypes=("f32",),
     steps='[["sub",[0,1],{}],["sigmoid",[2],{}]]')


def to_torch(x):
    if x is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(x.astype(np.float32) if x.dtype.kind == "f" else x))


def test_every_op_has_cases():
    from soma_runtime.ir.ops import OPS
    assert set(OPS) - {"all_reduce"} == {c.values[0] for c in CASES}     # all_reduce's need ranks: test_collective.py


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,make,ref,dt,attrs", CASES)
def test_op_matches_torch(backend, op, make, ref, dt, attrs):
    inputs = make(dt)
    want = ref(*[to_torch(x) for x in inputs])
    got = run_op(op, *inputs, backend=backend, **attrs)
    pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
    for g, w in pairs:
        w = w.numpy()
        assert g.shape == w.shape, f"{op}: shape {g.shape} != torch {w.shape}"
        if w.dtype.kind in "iub":
            np.testing.assert_array_equal(g, w)
            continue
        if op not in ("cast", "argmax"):
            assert str(g.dtype) == {"f32": "float32", "f16": "float16"}[dt], f"{op} returned {g.dtype}"
        err, scale = max_error(g, w)
        assert err <= TOL[dt] * scale, f"{op} on {backend}: max error {err:.3g} > {TOL[dt] * scale:.3g}"


# the cases no cuda jet takes (their op, or its dtypes): on cuda they run on the CPU backend, inputs copied there
HOSTED_ON_CUDA = {
    "div-int-trunc-f32", "div-int8-smallest-f32", "neg-int-f32", "reduce_sum-int-f32", "topk-int-f32",
    "range-int-f32", "range-float-f32", "range-down-f32", "nonzero-f32", "nonzero-f16",    # lengths the host learns
    "router-f32", "router-f16", "router-normalized-f32", "router-normalized-f16", "router-sigmoid-bias-f32",
    "moe_ffn-f32", "moe_ffn-f16", "moe_ffn-one-token-f32", "moe_ffn-one-token-f16",
    "lora_apply-f32", "lora_apply-f16", "lora_apply-no-adapter-f32", "lora_apply-no-adapter-f16",
    "lora_apply-dora-f32", "lora_apply-dora-f16", "lora_apply-norm-residual-f32", "lora_apply-norm-residual-f16",
    "lora_apply-many-rows-f32", "lora_apply-many-rows-f16",
    "chain-f32", "chain-broadcast-f32",
    *(f"non_max_suppression-{v}-{dt}" for v in ("corners-40-None", "corners-4-0.3", "center-40-None", "center-4-0.3")
      for dt in ("f32", "f16")),                                  # a greedy walk, box by box: the host's
}


@pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")
def test_cuda_runs_every_other_case_on_its_own_jet():
    """The op test on cuda checks cuda's jets: a case that falls back to the CPU (passing, as the CPU's) is
    one listed in HOSTED_ON_CUDA."""
    from soma_runtime.backends import get
    from soma_runtime.ir.graph import meta_of
    from soma_runtime.ir.jets import REGISTRY
    from soma_runtime.ir.ops import OPS
    hosted = set()
    for c in CASES:
        op, make, _, dt, attrs = c.values
        inputs = OPS[op].pad(make(dt))
        kernel = REGISTRY.kernel_for(OPS[op], [None if x is None else meta_of(x) for x in inputs], attrs, get("cuda"))
        if getattr(kernel, "hosted", False):
            hosted.add(c.id)
    assert hosted == HOSTED_ON_CUDA


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_negative_pads_crop_as_torchs(backend):
    """A negative pad (an exported graph's pad of a size its input decides) crops; a variant no jet is
    registered for (its formula slices first), run by the atoms."""
    x = mk((2, 5, 4))("f32")[0]
    got = run_op("pad", x, backend=backend, pads=((0, 0), (1, -2), (-1, 2)), value=0.5)
    np.testing.assert_array_equal(got, F.pad(torch.from_numpy(x), (-1, 2, 1, -2), value=0.5).numpy())

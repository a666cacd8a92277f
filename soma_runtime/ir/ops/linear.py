"""Matrix products (with their fused norm, bias, residual and epilogue), attention, rope and embedding."""
from __future__ import annotations

import math

from soma_runtime.dtypes import dtype
from soma_runtime.ir.graph import Sym, TensorMeta, same_dim
from soma_runtime.ir.ops.base import (
    attention_mask,
    broadcast_shapes,
    check,
    dequant_if_needed,
    float_dtype,
    gelu_atoms,
    matmul_nk,
    op,
    same_dtype,
    softmax_atoms,
)
from soma_runtime.ir.ops.elementwise import geglu, swiglu
from soma_runtime.ir.ops.norm import rmsnorm


def matmul_rule(metas, attrs):
    a, b = metas[:2]
    bias = metas[2] if len(metas) > 2 else None
    residual = metas[3] if len(metas) > 3 else None
    norm = metas[4] if len(metas) > 4 else None
    dt = float_dtype(a, "activation")
    check(a.ndim >= 2 and b.ndim >= 2, "matmul needs rank >= 2 operands")
    check(attrs["activations"] in ("f32", "bf16", "q8"), f"activations must be f32, bf16 or q8, got {attrs['activations']!r}")
    check(attrs["epilogue"] in EPILOGUES, f"epilogue must be one of {', '.join(EPILOGUES)}, got {attrs['epilogue']!r}")
    if dtype(b.dtype).quantized:
        check(attrs["transpose_b"] and b.ndim == 2, f"a {b.dtype} weight must be 2-D [N, K] with transpose_b")
    else:
        float_dtype(b, "weight")
    n, k = (b.shape[-2], b.shape[-1]) if attrs["transpose_b"] else (b.shape[-1], b.shape[-2])
    check(same_dim(a.shape[-1], k) is not False, f"inner dims differ: {a.shape[-1]} vs {k}")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if bias is not None:
        float_dtype(bias, "bias")
        check(bias.ndim == 1 and same_dim(bias.shape[0], n) is not False, f"bias must be [{n}], got {list(bias.shape)}")
    if attrs["epilogue"] in GATED:
        check(not isinstance(n, int) or n % 2 == 0, f"a gated epilogue takes (gate, up) column pairs: {n} columns")
        n = n // 2
    out = batch + (a.shape[-2], n)
    if norm is not None:
        float_dtype(norm, "norm weight")
        check(norm.ndim == 1 and same_dim(norm.shape[0], a.shape[-1]) is not False,
              f"norm weight must be [{a.shape[-1]}], got {list(norm.shape)}")
    if residual is not None:
        float_dtype(residual, "residual")
        check(residual.ndim == len(out) and all(same_dim(r, o) is not False for r, o in zip(residual.shape, out)),
              f"residual must be {list(out)}, got {list(residual.shape)}")
    return [TensorMeta(out, dt)]


EPILOGUES = ("none", "gelu", "gelu_tanh", "swiglu", "geglu_tanh")      # what a matmul may apply to its result
GATED = ("swiglu", "geglu_tanh")      # gated activations over the result's interleaved (gate, up) column pairs


@op("matmul", ["a", "b", "bias?", "residual?", "norm?"], matmul_rule,
    attrs={"transpose_b": False, "activations": "f32", "epilogue": "none", "norm_eps": 1e-6},
    struct={"transpose_b": (False, True), "epilogue": EPILOGUES}, tol=4.0, ranks=(2, 2, 1, 2, 1))
def matmul(A, a, b, bias, residual, norm, transpose_b, activations, epilogue, norm_eps):
    """epilogue(rmsnorm(a) @ b (+ bias, a linear layer's)) (+ residual, the stream a block's output
    joins): with a `norm` weight, a is rms-normalized first (a pre-norm block's input), and a kernel
    does it all in one pass: the row's 1/rms scales the finished dot products, the epilogue and the
    residual apply while they are still in registers. A gated epilogue (swiglu, geglu_tanh) pairs
    columns 2i (gate) and 2i + 1 (up) into column i: a gated MLP's gate and up weights interleaved by
    rows, so one matrix-vector program holds both halves of its outputs. `activations="q8"` lets a kernel quantize activations
    per 32-block before an integer dot with
    block-quantized weights, as llama.cpp does; "bf16" lets it round them to bf16 for a bf16 weight
    (matrix units): precision hints, the formula is the same product."""
    b = dequant_if_needed(A, b)
    if not transpose_b:
        b = A.read("transpose", b, axis1=-1, axis2=-2)
    if norm is not None:
        a = rmsnorm(A, a, norm, norm_eps)
    y = matmul_nk(A, a, b)
    y = y if bias is None else A.add(y, bias)
    if epilogue in GATED:
        gate, up = (A.read("slice", y, axis=-1, start=start, stop=None, step=2) for start in (0, 1))
        y = swiglu(A, gate, up) if epilogue == "swiglu" else geglu(A, gate, up, "tanh")
    elif epilogue != "none":
        y = gelu_atoms(A, y, "tanh" if epilogue == "gelu_tanh" else "none")
    return y if residual is None else A.add(y, residual)


def sdpa_rule(metas, attrs):
    q, k, v = metas[:3]
    mask = metas[3] if len(metas) > 3 else None
    float_dtype(q)
    same_dtype(k, v)
    float_dtype(k, "k/v")
    check(q.ndim == 4 and k.ndim == 4 and v.ndim == 4, "sdpa takes q, k, v as [B, H, S, D]")
    check(attrs["precision"] in ("f32", "bf16"), f"precision must be f32 or bf16, got {attrs['precision']!r}")
    if isinstance(q.shape[1], int) and isinstance(k.shape[1], int):
        check(q.shape[1] % k.shape[1] == 0, f"query heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    check(same_dim(q.shape[3], k.shape[3]) is not False, "q and k head dims differ")
    check(same_dim(k.shape[2], v.shape[2]) is not False, "k and v lengths differ")
    out = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    if mask is not None:
        float_dtype(mask, "mask")
        broadcast_shapes(out[:3] + (k.shape[2],), mask.shape)
    return [TensorMeta(out, q.dtype)]


@op("sdpa", ["q", "k", "v", "mask?"], sdpa_rule,
    attrs={"causal": False, "scale": None, "softcap": 0.0, "window": 0, "precision": "f32"},
    struct={"causal": (False, True), "softcap": (0.0, 30.0), "window": (0, 4)}, tol=4.0, ranks=(4, 4, 4, 4))
def sdpa(A, q, k, v, mask, causal, scale, softcap, window, precision):
    """Scaled dot-product attention. With k/v in a narrower float dtype than q (an f16 KV cache),
    q and the probabilities are rounded to that dtype before their products, as llama.cpp does.
    `precision="bf16"` lets a kernel round the products' inputs to bf16 (f32 accumulation and
    softmax): a hint, like matmul's activations."""
    B, Hq, Sq, D = q.shape
    q_dtype = q.dtype
    Hkv, Sk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1 / math.sqrt(D) if isinstance(D, int) else Sym(f"1/sqrt({D})")
    if k.dtype != q.dtype:        # attention runs in the cache's precision: q is rounded to it (as llama.cpp)
        q = A.read("cast", q, struct=(k.dtype,))
    # GQA: the G query heads that share a kv head become extra query rows of that head
    grouped = A.read("reshape", q, shape=(B, Hkv, (Hq // Hkv) * Sq, D))
    scores = A.read("reshape", matmul_nk(A, grouped, k), shape=(B, Hq, Sq, Sk))
    scores = A.mul(scores, A.param(scale))
    if softcap:
        scores = A.mul(A.exp("tanh", A.mul(scores, A.param(1 / softcap))), A.param(softcap))
    if mask is not None:
        scores = A.add(scores, mask)
    if causal or window:
        scores = attention_mask(A, scores, Sq, Sk, causal, window)
    probs = A.read("reshape", softmax_atoms(A, scores, -1), shape=(B, Hkv, (Hq // Hkv) * Sq, Sk))
    if v.dtype != q_dtype:
        probs = A.read("cast", probs, struct=(v.dtype,))
    out = matmul_nk(A, probs, A.read("transpose", v, axis1=-1, axis2=-2))
    return A.read("reshape", out, shape=(B, Hq, Sq, v.shape[3]))


def rope_rule(metas, attrs):
    x, pos, inv_freq = metas
    float_dtype(x)
    check(pos.dtype in ("i32", "i64"), f"positions must be integer, got {pos.dtype}")
    check(inv_freq.ndim == 1 and inv_freq.dtype == "f32", "inv_freq must be a 1-D f32 tensor")
    check(x.ndim >= 3, "rope takes x as [..., S, H, D]")
    if isinstance(inv_freq.shape[0], int) and isinstance(x.shape[-1], int):
        check(2 * inv_freq.shape[0] <= x.shape[-1], f"rotary dims {2 * inv_freq.shape[0]} exceed head dim {x.shape[-1]}")
    broadcast_shapes(x.shape[:-2], pos.shape)
    return [x]


@op("rope", ["x", "positions", "inv_freq"], rope_rule, attrs={"style": "neox"},
    struct={"style": ("neox", "interleaved")}, ranks=(4, 2, 1))
def rope(A, x, positions, inv_freq, style):
    """Rotate the first 2*len(inv_freq) dims of each head; the rest pass through (partial rotary)."""
    half, D = inv_freq.shape[0], x.shape[-1]
    angle = A.mul(A.read("expand", A.read("cast", positions, struct=("f32",)), axis=-1), inv_freq)
    angle = A.read("expand", angle, axis=-2)                                   # [..., S, 1, R/2]
    cos, sin = A.exp("cos", angle), A.exp("sin", angle)
    if style == "neox":   # pairs (i, i + R/2)
        first = A.read("slice", x, axis=-1, start=0, stop=half)
        second = A.read("slice", x, axis=-1, start=half, stop=2 * half)
        starts, step = (0, half), 1
    else:                 # pairs (2i, 2i + 1)
        first = A.read("slice", x, axis=-1, start=0, stop=2 * half, step=2)
        second = A.read("slice", x, axis=-1, start=1, stop=2 * half, step=2)
        starts, step = (0, 1), 2
    out_first = A.sub(A.mul(first, cos), A.mul(second, sin))
    out_second = A.add(A.mul(second, cos), A.mul(first, sin))
    out = A.read("fill", shape=x.shape, value=0.0)
    out = A.write("place", out, out_first, axes=(-1,), starts=(starts[0],), steps=(step,))
    out = A.write("place", out, out_second, axes=(-1,), starts=(starts[1],), steps=(step,))
    rest = A.read("slice", x, axis=-1, start=2 * half, stop=D)
    return A.write("place", out, rest, axes=(-1,), starts=(2 * half,), steps=(1,))


def embedding_rule(metas, attrs):
    table, ids = metas
    check(table.ndim == 2, "embedding table must be [vocab, dim]")
    check(ids.dtype in ("i32", "i64"), f"token ids must be integer, got {ids.dtype}")
    dt = "f32" if dtype(table.dtype).quantized else float_dtype(table, "table")
    return [TensorMeta(tuple(ids.shape) + (table.shape[1],), dt)]


@op("embedding", ["table", "ids"], embedding_rule, ranks=(2, 1))
def embedding(A, table, ids):
    return A.read("take", dequant_if_needed(A, table), ids, axis=0)

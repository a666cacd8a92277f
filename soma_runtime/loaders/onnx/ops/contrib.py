"""onnxruntime's contrib ops (the com.microsoft domain, and the few it registers in ai.onnx) that its own
tools write: the gelus, the embedding, skip and simplified layer norms, MatMulNBits, FusedConv, the attentions
and rotary embeddings, the QOperator format's quantized ops (QGemm, QLinearAdd, ...) and DynamicQuantizeLSTM.
Each as onnxruntime's ContribOperators.md defines it (and, where that leaves the arithmetic open, as its CPU
kernel is written), in the IR's ops; it never calls onnxruntime."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from soma_runtime.dtypes import dtype
from soma_runtime.ir.graph import same_dim
from soma_runtime.loaders.onnx.ops import nn, quantize, recurrent
from soma_runtime.loaders.onnx.ops.elementwise import hard_sigmoid_of, scalar
from soma_runtime.loaders.onnx.ops.layout import reshape_to
from soma_runtime.loaders.onnx.ops.quantize import (
    as_f32,
    centered,
    dynamically_quantized,
    integer_product,
    requantized,
    saturated,
)
from soma_runtime.loaders.onnx.ops.table import onnx_op

MS = "com.microsoft"


def biased(cv, x, bias):
    return x if bias is None else cv.emit("add", x, bias)


@onnx_op("Gelu", domain=MS)
def gelu(cv, n):
    return cv.emit("gelu", n.inputs[0], approximate="none")


@onnx_op("BiasGelu", domain=MS)
def bias_gelu(cv, n):
    return cv.emit("gelu", biased(cv, n.inputs[0], n.input(1)), approximate="none")


@onnx_op("FastGelu", domain=MS)
def fast_gelu(cv, n):
    return cv.emit("gelu", biased(cv, n.inputs[0], n.input(1)), approximate="tanh")


@onnx_op("QuickGelu", domain=MS)
def quick_gelu(cv, n):
    x = n.inputs[0]
    return cv.emit("mul", x, cv.emit("sigmoid", cv.emit("mul", x, scalar(cv, n.attr("alpha", 1.702), x))))


def moments(cv, x, eps: float, centered: bool):
    """The mean (0 where not `centered`) and 1 / sqrt(variance + eps) over the last axis, kept as size 1."""
    last = (cv.meta(x).ndim - 1,)
    mean = cv.emit("reduce_mean", x, axes=last, keepdims=True) if centered else None
    d = cv.emit("sub", x, mean) if centered else x
    var = cv.emit("reduce_mean", cv.emit("mul", d, d), axes=last, keepdims=True)
    return mean, cv.emit("rsqrt", cv.emit("add", var, scalar(cv, eps, x)))


def skip_sum(cv, n, bias_at: int):
    x = cv.emit("add", n.inputs[0], n.inputs[1])
    return biased(cv, x, n.input(bias_at))


@onnx_op("SkipLayerNormalization", domain=MS)
def skip_layer_norm(cv, n):
    """layernorm(input + skip + bias) * gamma + beta; outputs y, mean, 1 / std, and the sum."""
    total = skip_sum(cv, n, 4)
    eps = float(n.attr("epsilon", 1e-12))
    y = cv.emit("layernorm", total, n.inputs[2], n.input(3), eps=eps)
    mean, inv = moments(cv, total, eps, centered=True) if n.n_outputs in (2, 3) else (None, None)
    return [y, mean, inv, total][:n.n_outputs]


@onnx_op("SkipSimplifiedLayerNormalization", domain=MS)
def skip_simplified_layer_norm(cv, n):
    """rmsnorm(input + skip + bias) * gamma; outputs y, mean (unused), 1 / rms, and the sum."""
    total = skip_sum(cv, n, 3)
    eps = float(n.attr("epsilon", 1e-12))
    y = cv.emit("rmsnorm", total, n.inputs[2], eps=eps)
    inv = moments(cv, total, eps, centered=False)[1] if n.n_outputs in (2, 3) else None
    return [y, None, inv, total][:n.n_outputs]


@onnx_op("SimplifiedLayerNormalization")
@onnx_op("SimplifiedLayerNormalization", domain=MS)
def simplified_layer_norm(cv, n):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis (the only one its exporters use)."""
    x, weight = n.inputs[0], n.inputs[1]
    rank = cv.meta(x).ndim
    if cv.axis(n.attr("axis", -1), rank) != rank - 1:
        raise cv.unsupported(f"normalizing from axis {n.attr('axis')} (only the last axis is supported)")
    eps = float(n.attr("epsilon", 1e-5))
    y = cv.emit("rmsnorm", x, weight, eps=eps)
    return [y, moments(cv, x, eps, centered=False)[1]][:n.n_outputs] if n.n_outputs > 1 else y


ACTIVATIONS = {
    "Relu": lambda cv, x, p: cv.emit("relu", x),
    "Tanh": lambda cv, x, p: cv.emit("tanh", x),
    "Sigmoid": lambda cv, x, p: cv.emit("sigmoid", x),
    "LeakyRelu": lambda cv, x, p: cv.emit("leaky_relu", x, negative_slope=float(p[0] if p else 0.01)),
    "Clip": lambda cv, x, p: cv.emit("clip", x, min=float(p[0]), max=float(p[1])),
    "HardSigmoid": lambda cv, x, p: hard_sigmoid_of(cv, x, float(p[0]), float(p[1])),
}


@onnx_op("FusedConv", domain=MS)
def fused_conv(cv, n):
    """activation(conv(x, w, b) + z), the activation and its parameters named by attributes."""
    activation = n.attr("activation", "")
    if activation and activation not in ACTIVATIONS:
        raise cv.unsupported(f"FusedConv's activation {activation!r}")
    y = biased(cv, nn.conv(cv, n), n.input(3))
    return ACTIVATIONS[activation](cv, y, list(n.attr("activation_params", []))) if activation else y


def unpacked(packed: np.ndarray, bits: int) -> np.ndarray:
    """Bytes holding 8 // bits values each, the lowest bits first, as one value per element."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:-1], -1)


@onnx_op("MatMulNBits", domain=MS)
def matmul_nbits(cv, n):
    """A @ W.T + bias for W [N, K] stored as `bits`-bit integers in blocks of `block_size` along K, each
    block (q - zero point) * its scale (zero points packed like q, or floats; 2^(bits-1) where none are given).
    Dequantized at load."""
    a, packed, scales, zeros = n.inputs[0], n.inputs[1], n.inputs[2], n.input(3)
    bits, block = int(n.attr("bits", 4)), int(n.attr("block_size"))
    k, rows = int(n.attr("K")), int(n.attr("N"))
    if bits not in (2, 4, 8):
        raise cv.unsupported(f"{bits}-bit weights (2, 4 and 8 bits are supported)")
    if n.input(4) is not None:
        raise cv.unsupported("a g_idx input (act-order weights)")
    packed = cv.known(packed, "packed weights")
    scales = cv.known(scales, "scales").astype(np.float32)
    blocks = -(-k // block)
    q = unpacked(packed.reshape(rows, blocks, -1), bits)[:, :, :block].astype(np.float32)      # [N, blocks, block]
    if zeros is None:
        zero = np.float32(1 << (bits - 1))
    else:
        zeros = cv.known(zeros, "zero points")
        if zeros.dtype == np.uint8:
            zero = unpacked(zeros.reshape(rows, -1), bits)[:, :blocks].astype(np.float32)[..., None]
        elif zeros.dtype.kind == "f":
            zero = zeros.astype(np.float32).reshape(rows, blocks, 1)
        else:
            raise cv.unsupported(f"{zeros.dtype} zero points (packed uint8 or float ones are supported)")
    w = ((q - zero) * scales.reshape(rows, blocks, 1)).reshape(rows, -1)[:, :k]
    y = cv.emit("matmul", cv.emit("cast", a, dtype="f32") if cv.meta(a).dtype != "f32" else a,
                np.ascontiguousarray(w), transpose_b=True)
    y = y if cv.meta(a).dtype == "f32" else cv.emit("cast", y, dtype=cv.meta(a).dtype)
    return biased(cv, y, n.input(5))


@onnx_op("EmbedLayerNormalization", domain=MS)
def embed_layer_norm(cv, n):
    """layernorm(word[ids] + position[position ids, else 0..S-1] + segment[segment ids]) * gamma + beta;
    outputs y, the mask's count of kept tokens per row (mask_index), and the embeddings' sum."""
    return embedded(cv, n, *(n.input(i) for i in range(9)))


def embedded(cv, n, ids, segments, word, position, segment, gamma, beta, mask, positions):
    if n.attr("mask_index_type", 1) != 1:
        raise cv.unsupported(f"mask_index_type {n.attr('mask_index_type')} (1 is supported)")
    total = cv.emit("take", word, ids, axis=0)
    if positions is None:
        positions = reshape_to(cv, cv.arange(cv.meta(ids).shape[1]), (1, -1))
    total = cv.emit("add", total, cv.emit("take", position, positions, axis=0))
    if segment is not None and segments is not None:
        total = cv.emit("add", total, cv.emit("take", segment, segments, axis=0))
    y = cv.emit("layernorm", total, gamma, beta, eps=float(n.attr("epsilon", 1e-12)))
    if mask is None:
        kept = cv.emit("reduce_sum", cv.emit("mul", cv.emit("cast", ids, dtype="i32"), np.array(0, np.int32)),
                       axes=(1,), keepdims=False)
    else:
        kept = cv.emit("cast", cv.emit("greater", mask, np.zeros((), dtype(cv.meta(mask).dtype).numpy)), dtype="i32")
        kept = cv.emit("reduce_sum", kept, axes=(1,), keepdims=False)
    return [y, kept, total][:n.n_outputs]


def key_mask(cv, n, mask, batch, rows, keys):
    """Attention's mask_index as an additive [B, 1, S or 1, T] mask: 0 where a key is kept, mask_filter_value
    where not; from key lengths [B] (right padding), a raw [B, T] or [B, S, T] mask of 1 (keep) and 0."""
    fill = np.float32(n.attr("mask_filter_value", -10000.0))
    rank = cv.meta(mask).ndim
    if rank == 1:
        if same_dim(cv.meta(mask).shape[0], batch) is False:
            raise cv.unsupported(f"a mask_index of {list(cv.meta(mask).shape)} (key lengths [B] are supported, "
                                 f"start and end positions [2B] are not)")
        lengths = reshape_to(cv, cv.emit("cast", mask, dtype="i64"), (-1, 1, 1, 1))
        keep = cv.emit("less", reshape_to(cv, cv.arange(keys), (1, 1, 1, -1)), lengths)
    elif rank in (2, 3):
        keep = cv.emit("greater", mask, np.zeros((), dtype(cv.meta(mask).dtype).numpy))
        keep = reshape_to(cv, keep, (batch, 1, 1 if rank == 2 else rows, keys))
    else:
        raise cv.unsupported(f"a {rank}-D mask_index")
    return cv.emit("where", keep, np.float32(0.0), fill)


@onnx_op("Attention", domain=MS)
def attention(cv, n):
    """Multi-head self-attention of input @ weights + bias split into q, k, v (qkv_hidden_sizes, else
    thirds); softmax(q k^T * scale + masks) v, heads joined. Past and present key/values are refused."""
    x, weights, bias, mask = n.inputs[0], n.inputs[1], n.input(2), n.input(3)
    if n.input(4) is not None or n.n_outputs > 1:
        raise cv.unsupported("past or present key/values (only self-attention without a cache is supported)")
    if n.attr("do_rotary", 0):
        raise cv.unsupported("Attention with do_rotary")
    qkv = biased(cv, nn.matrix_product(cv, x, weights, transposed=False), bias)
    return attended(cv, n, qkv, mask, n.input(5))


def attended(cv, n, qkv, mask, extra):
    """Attention's heads over qkv [B, S, q + k + v widths]."""
    heads = int(n.attr("num_heads"))
    batch, rows, width = cv.meta(qkv).shape
    sizes = [int(s) for s in n.attr("qkv_hidden_sizes") or [width // 3] * 3]
    q, k, v = cv.emit("split", qkv, sizes=tuple(sizes), axis=2)

    def by_heads(t, size):
        return cv.emit("permute", reshape_to(cv, t, (batch, rows, heads, size // heads)), perm=(0, 2, 1, 3))

    additive = key_mask(cv, n, mask, batch, rows, rows) if mask is not None else None
    if extra is not None:
        additive = extra if additive is None else cv.emit("add", additive, extra)
    scale = n.attr("scale")
    y = cv.emit("sdpa", by_heads(q, sizes[0]), by_heads(k, sizes[1]), by_heads(v, sizes[2]), additive,
                causal=bool(n.attr("unidirectional", 0)), scale=None if not scale else float(scale))
    return reshape_to(cv, cv.emit("permute", y, perm=(0, 2, 1, 3)), (batch, rows, sizes[2]))


def rotated(cv, x, cos, sin, interleaved: bool):
    """x's last axis rotated by the angles whose cos and sin (half its width) broadcast over it: halves
    (x1, x2) or, `interleaved`, even and odd lanes, each pair (x1 cos - x2 sin, x1 sin + x2 cos)."""
    rank, width = cv.meta(x).ndim, cv.meta(x).shape[-1]
    half = width // 2
    if interleaved:
        x1 = cv.emit("slice", x, axis=rank - 1, start=0, stop=width, step=2)
        x2 = cv.emit("slice", x, axis=rank - 1, start=1, stop=width, step=2)
    else:
        x1 = cv.emit("slice", x, axis=rank - 1, start=0, stop=half)
        x2 = cv.emit("slice", x, axis=rank - 1, start=half, stop=width)
    y1 = cv.emit("sub", cv.emit("mul", x1, cos), cv.emit("mul", x2, sin))
    y2 = cv.emit("add", cv.emit("mul", x1, sin), cv.emit("mul", x2, cos))
    if not interleaved:
        return cv.emit("concat", y1, y2, axis=rank - 1)
    lead = cv.meta(y1).shape[:-1]
    pairs = cv.emit("concat", reshape_to(cv, y1, lead + (half, 1)), reshape_to(cv, y2, lead + (half, 1)), axis=rank)
    return reshape_to(cv, pairs, lead + (width,))


@onnx_op("RotaryEmbedding", domain=MS)
def rotary_embedding(cv, n):
    """Rotary position embedding of x [B, S, hidden] or [B, N, S, H] from cos/sin caches [positions, R/2]
    read at position_ids ([B, S], or one offset for 0..S-1); the first R lanes of each head rotated."""
    x, positions, cos_cache, sin_cache = n.inputs[:4]
    if n.attr("is_packed_batching", 0):
        raise cv.unsupported("packed batching")
    shape = cv.meta(x).shape
    half = cv.meta(cos_cache).shape[1]
    heads = int(n.attr("num_heads", 0))
    if len(shape) == 3:
        heads = heads or shape[2] // (2 * half)           # without num_heads, a head is the caches' width
        batch, rows = shape[0], shape[1]
        view = reshape_to(cv, x, (batch, rows, heads, shape[2] // heads))
    elif len(shape) == 4:
        batch, rows = shape[0], shape[2]
        view = cv.emit("permute", x, perm=(0, 2, 1, 3))
    else:
        raise cv.unsupported(f"a rank {len(shape)} input (3 or 4 are supported)")
    head = cv.meta(view).shape[3]
    width = int(n.attr("rotary_embedding_dim", 0)) or head
    if width != 2 * half:
        raise cv.invalid(f"rotary_embedding_dim {width} is not twice the caches' {half}")
    if cv.meta(positions).ndim <= 1:
        positions = cv.emit("add", reshape_to(cv, cv.arange(rows), (1, -1)),
                            reshape_to(cv, cv.emit("cast", positions, dtype="i64"), (1, 1)))
    cos = reshape_to(cv, cv.emit("take", cos_cache, positions, axis=0), (-1, rows, 1, half))
    sin = reshape_to(cv, cv.emit("take", sin_cache, positions, axis=0), (-1, rows, 1, half))
    turned = view if width == head else cv.emit("slice", view, axis=3, start=0, stop=width)
    turned = rotated(cv, turned, cos, sin, bool(n.attr("interleaved", 0)))
    if width != head:
        turned = cv.emit("concat", turned, cv.emit("slice", view, axis=3, start=width, stop=head), axis=3)
    return reshape_to(cv, turned, shape) if len(shape) == 3 else cv.emit("permute", turned, perm=(0, 2, 1, 3))


@onnx_op("MultiHeadAttention", domain=MS)
def multi_head_attention(cv, n):
    """softmax((q + bq)(k + bk)^T * scale + masks)(v + bv) over `num_heads` heads, for query [B, S, D] and
    key, value [B, L, D] (or already split [B, N, L, H]); key_padding_mask as key lengths [B] or a raw
    [B, L] mask; attention_bias added. Packed inputs and past key/values are refused."""
    q, k, v, bias, mask, extra = (n.input(i) for i in range(6))
    if k is None or v is None or cv.meta(q).ndim != 3 or n.input(6) is not None or n.n_outputs > 1:
        raise cv.unsupported("packed q/k/v, or past or present key/values (separate q, k, v without a cache "
                             "are supported)")
    heads = int(n.attr("num_heads"))
    batch, rows, width = cv.meta(q).shape
    split = cv.meta(k).ndim == 4
    if bias is not None:
        v_width = cv.meta(v).shape[1] * cv.meta(v).shape[3] if split else cv.meta(v).shape[2]
        bq, bk, bv = cv.emit("split", bias, sizes=(width, width, v_width), axis=0)
        q = cv.emit("add", q, bq)
        if not split:
            k, v = cv.emit("add", k, bk), cv.emit("add", v, bv)
        else:
            k = cv.emit("add", k, reshape_to(cv, bk, (1, heads, 1, -1)))
            v = cv.emit("add", v, reshape_to(cv, bv, (1, heads, 1, -1)))

    def by_heads(t):
        if cv.meta(t).ndim == 4:
            return t
        b, length, size = cv.meta(t).shape
        return cv.emit("permute", reshape_to(cv, t, (b, length, heads, size // heads)), perm=(0, 2, 1, 3))

    q, k, v = by_heads(q), by_heads(k), by_heads(v)
    keys = cv.meta(k).shape[2]
    additive = key_mask(cv, n, mask, batch, rows, keys) if mask is not None else None
    if extra is not None:
        additive = extra if additive is None else cv.emit("add", additive, extra)
    scale = n.attr("scale")
    y = cv.emit("sdpa", q, k, v, additive, causal=bool(n.attr("unidirectional", 0)),
                scale=None if not scale else float(scale))
    return reshape_to(cv, cv.emit("permute", y, perm=(0, 2, 1, 3)), (batch, rows, cv.meta(y).shape[1] * cv.meta(y).shape[3]))


def heads_first(cv, t, heads: int):
    b, rows, width = cv.meta(t).shape
    return cv.emit("permute", reshape_to(cv, t, (b, rows, heads, width // heads)), perm=(0, 2, 1, 3))


@onnx_op("GroupQueryAttention", domain=MS)
def group_query_attention(cv, n):
    """Causal attention of `num_heads` query heads over `kv_num_heads` key/value heads, the new keys and
    values appended to the past ones (present = past + new). Batch b's keys are its first seqlens_k[b] + 1;
    its queries sit at the end of those (the first prompt, without a past: at the start), where rotary
    embeddings (do_rotary) read the caches. Packed q/k/v split first."""
    q, k, v, past_k, past_v, seqlens = (n.input(i) for i in range(6))
    cos_cache, sin_cache, positions = n.input(7), n.input(8), n.input(9)
    for i, what in ((10, "attention_bias"), (11, "head_sink")):
        if n.input(i) is not None:
            raise cv.unsupported(f"a {what} input")
    if n.attr("smooth_softmax", 0) or n.attr("softcap", 0.0) or n.attr("local_window_size", -1) not in (-1, 0):
        raise cv.unsupported("smooth softmax, softcap or a local window")
    if n.n_outputs > 3:
        raise cv.unsupported("the output_qk output")
    heads, kv_heads = int(n.attr("num_heads")), int(n.attr("kv_num_heads"))
    batch, rows, width = cv.meta(q).shape
    if k is None:
        size = width // (heads + 2 * kv_heads)
        q, k, v = cv.emit("split", q, sizes=(heads * size, kv_heads * size, kv_heads * size), axis=2)
    q, k, v = heads_first(cv, q, heads), heads_first(cv, k, kv_heads), heads_first(cv, v, kv_heads)
    first_prompt = past_k is None or cv.meta(past_k).shape[2] == 0
    lengths = reshape_to(cv, cv.emit("add", cv.emit("cast", seqlens, dtype="i64"), np.array(1, np.int64)), (-1, 1, 1, 1))
    start = np.zeros((1, 1, 1, 1), np.int64) if first_prompt else cv.emit("sub", lengths, np.array(rows, np.int64))
    query_at = cv.emit("add", start, reshape_to(cv, cv.arange(rows), (1, 1, -1, 1)))            # [B, 1, S, 1]
    if n.attr("do_rotary", 0):
        if positions is None:
            positions = reshape_to(cv, query_at, (-1, rows))
        half = cv.meta(cos_cache).shape[1]
        cos = reshape_to(cv, cv.emit("take", cos_cache, positions, axis=0), (-1, 1, rows, half))
        sin = reshape_to(cv, cv.emit("take", sin_cache, positions, axis=0), (-1, 1, rows, half))
        interleaved = bool(n.attr("rotary_interleaved", 0))
        head = cv.meta(q).shape[3]

        def turned(t):
            if 2 * half == head:
                return rotated(cv, t, cos, sin, interleaved)
            part = rotated(cv, cv.emit("slice", t, axis=3, start=0, stop=2 * half), cos, sin, interleaved)
            return cv.emit("concat", part, cv.emit("slice", t, axis=3, start=2 * half, stop=head), axis=3)
        q, k = turned(q), turned(k)
    if not first_prompt:
        k, v = cv.emit("concat", past_k, k, axis=2), cv.emit("concat", past_v, v, axis=2)
    keys = cv.meta(k).shape[2]
    key_at = reshape_to(cv, cv.arange(keys), (1, 1, 1, -1))
    keep = cv.emit("logical_and", cv.emit("less_equal", key_at, query_at), cv.emit("less", key_at, lengths))
    additive = cv.emit("where", keep, np.float32(0.0), np.float32(-np.inf))
    scale = n.attr("scale")
    y = cv.emit("sdpa", q, k, v, cv.emit("cast", additive, dtype=cv.meta(q).dtype) if cv.meta(q).dtype != "f32" else additive,
                scale=None if not scale else float(scale))
    y = reshape_to(cv, cv.emit("permute", y, perm=(0, 2, 1, 3)), (batch, rows, heads * cv.meta(y).shape[3]))
    return [y, k, v][:n.n_outputs]


# --- quantized operators (what quantize_static writes in its QOperator format) -----------------

def dequantized(cv, x, scale, zero):
    """(x - zero) * scale in f32."""
    return cv.emit("mul", centered(cv, x, zero), as_f32(cv, scale))


def requantize(cv, y, scale, zero, like):
    """f32 y as `like`'s integer type: y / scale rounded half to even, plus the zero point, saturated."""
    return requantized_float(cv, cv.emit("div", y, as_f32(cv, scale)), zero, cv.meta(like).dtype)


def requantized_float(cv, y, zero, target):
    y = cv.emit("round", y)
    if zero is not None:
        y = cv.emit("add", y, as_f32(cv, zero))
    return saturated(cv, y, target)


@onnx_op("QGemm", domain=MS)
def qgemm(cv, n):
    """alpha * (A - za)(B - zb) * a_scale * b_scale (+ C, an i32 bias at that scale): f32 out, or quantized
    to y_scale and y_zero_point where they are given."""
    a, a_scale, a_zero, b, b_scale, b_zero, c, y_scale, y_zero = (n.input(i) for i in range(9))
    if n.attr("transA", 0):
        a = cv.emit("permute", a, perm=(1, 0))
    if n.attr("transB", 0):
        b = cv.emit("permute", b, perm=(1, 0))
    acc = integer_product(cv, a, a_zero, b, b_zero)
    if c is not None:
        acc = cv.emit("add", acc, cv.emit("cast", c, dtype="i32"))
    scale = cv.emit("mul", cv.emit("mul", as_f32(cv, a_scale), as_f32(cv, b_scale)), np.float32(n.attr("alpha", 1.0)))
    if y_scale is None:
        return cv.emit("mul", cv.emit("cast", acc, dtype="f32"), scale)
    return requantized(cv, acc, cv.emit("div", scale, as_f32(cv, y_scale)), y_zero, cv.meta(y_zero).dtype
                       if y_zero is not None else cv.meta(a).dtype)


@onnx_op("QLinearGlobalAveragePool", domain=MS)
def qlinear_global_average_pool(cv, n):
    """The mean over each channel's image of x - x_zero, requantized at x_scale / y_scale."""
    x, x_scale, x_zero, y_scale, y_zero = n.inputs[:5]
    rank = cv.meta(x).ndim
    axes = tuple(range(1, rank - 1)) if n.attr("channels_last", 0) else tuple(range(2, rank))
    size = 1
    for a in axes:
        size = size * cv.meta(x).shape[a]
    total = cv.emit("reduce_sum", centered(cv, x, x_zero), axes=axes, keepdims=True)
    scale = cv.emit("div", as_f32(cv, x_scale), cv.emit("mul", as_f32(cv, y_scale),
                                                         cv.emit("cast", np.array(size, np.int64), dtype="f32")))
    return requantized_float(cv, cv.emit("mul", total, scale), y_zero, cv.meta(x).dtype)


@onnx_op("QLinearAdd", "QLinearMul", domain=MS)
def qlinear_binary(cv, n):
    a, a_scale, a_zero, b, b_scale, b_zero, c_scale, c_zero = (n.input(i) for i in range(8))
    sa, sb, sc = as_f32(cv, a_scale), as_f32(cv, b_scale), as_f32(cv, c_scale)
    if n.op_type == "QLinearMul":
        y = cv.emit("mul", cv.emit("mul", centered(cv, a, a_zero), centered(cv, b, b_zero)),
                    cv.emit("div", cv.emit("mul", sa, sb), sc))
    else:
        y = cv.emit("add", cv.emit("mul", centered(cv, a, a_zero), cv.emit("div", sa, sc)),
                    cv.emit("mul", centered(cv, b, b_zero), cv.emit("div", sb, sc)))
    return requantized_float(cv, y, c_zero, cv.meta(a).dtype)


@onnx_op("QLinearSigmoid", "QLinearLeakyRelu", domain=MS)
def qlinear_activation(cv, n):
    x, x_scale, x_zero, y_scale, y_zero = (n.input(i) for i in range(5))
    y = dequantized(cv, x, x_scale, x_zero)
    if n.op_type == "QLinearSigmoid":
        y = cv.emit("sigmoid", y)
    else:
        y = cv.emit("leaky_relu", y, negative_slope=float(n.attr("alpha", 0.01)))
    return requantize(cv, y, y_scale, y_zero, x)


@onnx_op("QLinearConcat", domain=MS)
def qlinear_concat(cv, n):
    """Each (x, scale, zero point) requantized to y's scale and zero point, joined along `axis`."""
    y_scale, y_zero = n.inputs[:2]
    parts = [requantize(cv, dequantized(cv, *n.inputs[i:i + 3]), y_scale, y_zero, n.inputs[i])
             for i in range(2, len(n.inputs), 3)]
    return cv.emit("concat", *parts, axis=cv.axis(n.attr("axis"), cv.meta(parts[0]).ndim))


def integer_product_to_float(cv, a, a_scale, a_zero, b, b_scale, b_zero, bias):
    """(A - za)(B - zb) exactly, then * a_scale * b_scale (b's per column where given) + bias, in f32."""
    acc = cv.emit("cast", integer_product(cv, a, a_zero, b, b_zero), dtype="f32")
    y = cv.emit("mul", acc, cv.emit("mul", as_f32(cv, a_scale), as_f32(cv, b_scale)))
    return biased(cv, y, bias)


@onnx_op("MatMulIntegerToFloat", domain=MS)
def matmul_integer_to_float(cv, n):
    a, b, a_scale, b_scale, a_zero, b_zero, bias = (n.input(i) for i in range(7))
    return integer_product_to_float(cv, a, a_scale, a_zero, b, b_scale, b_zero, bias)


@onnx_op("DynamicQuantizeMatMul", domain=MS)
def dynamic_quantize_matmul(cv, n):
    """A quantized to u8 as DynamicQuantizeLinear does, then MatMulIntegerToFloat with B."""
    a, b, b_scale, b_zero, bias = (n.input(i) for i in range(5))
    q, a_scale, a_zero = dynamically_quantized(cv, a)
    return integer_product_to_float(cv, q, a_scale, a_zero, b, b_scale, b_zero, bias)


@dataclass
class QuantizedProducts:
    """DynamicQuantizeLSTM's products as onnxruntime's kernel computes them: W [directions, input, 4 * hidden]
    and R [directions, hidden, 4 * hidden] in int8 or uint8, with a scale per direction or per column and a
    zero point per direction (the first where one per column is given, as onnxruntime reads them); the left
    side quantized to u8 as DynamicQuantizeLinear does: X once over all its steps, h at each step over the
    whole batch (as onnxruntime does unless it splits the batch across its threads: past 4 rows, or past 1
    where hidden <= 256); each product exact in i32, then times the two scales' product."""
    w: object
    w_scale: object
    w_zero: object
    r: object
    r_scale: object
    r_zero: object
    x: tuple | None = None          # X quantized once for both directions: (u8 values, scale, zero point)

    def inputs(self, cv, x, d: int):
        """x [rows, input] @ W[d], x quantized (once)."""
        if self.x is None:
            self.x = dynamically_quantized(cv, x)
        return integer_product_to_float(cv, *self.x, *self.direction(cv, self.w, self.w_scale, self.w_zero, d), None)

    def states(self, cv, d: int) -> tuple:
        """No f32 R, and the function giving h @ R[d], h quantized."""
        r = self.direction(cv, self.r, self.r_scale, self.r_zero, d)
        return None, lambda cv, h: integer_product_to_float(cv, *dynamically_quantized(cv, h), *r, None)

    @staticmethod
    def direction(cv, weights, scale, zero, d: int) -> tuple:
        """Direction d's weights, scale and zero point."""
        zero = recurrent.part(cv, zero, d)
        return (recurrent.part(cv, weights, d), recurrent.part(cv, scale, d),
                recurrent.part(cv, zero, 0) if cv.meta(zero).ndim else zero)


@onnx_op("DynamicQuantizeLSTM", domain=MS)
def dynamic_quantize_lstm(cv, n):
    """ONNX's LSTM over quantized weights (QuantizedProducts); W, R and their scales and zero points at 1, 2
    and 8-11."""
    if n.input(4) is not None:
        raise cv.unsupported("sequence_lens is not supported (onnxruntime quantizes X over the longest sequence's "
                             "steps alone)")
    for zero in (n.input(9), n.input(11)):
        if isinstance(zero, np.ndarray) and zero.ndim == 2 and (zero != zero[:, :1]).any():
            raise cv.invalid("its weights' zero points differ within a direction (one per direction is taken)")
    products = QuantizedProducts(n.input(1), n.input(8), n.input(9), n.input(2), n.input(10), n.input(11))
    return recurrent.lstm(cv, n, products)


@onnx_op("FusedGemm", domain=MS)
def fused_gemm(cv, n):
    """activation(Gemm), the activation's parameters from activation_alpha / activation_beta."""
    activation = n.attr("activation", "")
    if activation and activation not in ACTIVATIONS:
        raise cv.unsupported(f"FusedGemm's activation {activation!r}")
    y = nn.gemm(cv, n)
    if not activation:
        return y
    defaults = {"LeakyRelu": (0.01,), "HardSigmoid": (0.2, 0.5)}.get(activation, ())
    params = [n.attr("activation_alpha", defaults[0] if defaults else None), n.attr("activation_beta", defaults[1]
                                                                                    if len(defaults) > 1 else None)]
    return ACTIVATIONS[activation](cv, y, [p for p in params if p is not None])


@onnx_op("QEmbedLayerNormalization", domain=MS)
def qembed_layer_norm(cv, n):
    """EmbedLayerNormalization over its tables and norm weights dequantized (scales at 8-12, zero points 13-17)."""
    tables = [None if n.input(i) is None else dequantized(cv, n.input(i), n.input(i + 6), n.input(i + 11))
              for i in range(2, 7)]
    return embedded(cv, n, n.input(0), n.input(1), *tables, n.input(7), None)


@onnx_op("QAttention", domain=MS)
def qattention(cv, n):
    """Attention whose input @ weights is the exact integer product at input_scale * weight_scale, + bias."""
    x, weights, bias, x_scale, w_scale, mask, x_zero, w_zero = (n.input(i) for i in range(8))
    if n.input(8) is not None or n.n_outputs > 1:
        raise cv.unsupported("past or present key/values (only self-attention without a cache is supported)")
    qkv = integer_product_to_float(cv, x, x_scale, x_zero, weights, w_scale, w_zero, bias)
    return attended(cv, n, qkv, mask, None)


onnx_op("QuantizeLinear", domain=MS)(quantize.quantize_linear)         # as ai.onnx's (16-bit types written here
onnx_op("DequantizeLinear", domain=MS)(quantize.dequantize_linear)     # before ai.onnx had them)


@onnx_op("GemmFastGelu", domain=MS)
def gemm_fast_gelu(cv, n):
    """FastGelu(x @ w + bias)."""
    y = biased(cv, nn.matrix_product(cv, n.inputs[0], n.inputs[1], transposed=False), n.input(2))
    return cv.emit("gelu", y, approximate="tanh")


@onnx_op("BiasAdd", domain=MS)
def bias_add(cv, n):
    """x + bias + skip."""
    return cv.emit("add", cv.emit("add", n.inputs[0], n.inputs[1]), n.inputs[2])

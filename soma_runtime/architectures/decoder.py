"""The transformer decoder template: DecoderConfig + weights -> one Graph, read top to bottom (or a
graph of a run of its layers, for a model split across devices: DecoderIO says which).

embed -> N x (norm, attention over the paged KV cache, norm, gated mlp) -> norm -> head, as plain
math: each projection a matmul (plus its bias), rope, appends and attention each their own op. The
fuse pass then stacks q/k/v and gate/up, folds norms, residuals, rope and activations into the
kernels that run them. Its inputs and outputs are the contract's (contract.py): a step's rows are
independent but for the spans of context each attends, so one graph serves a prompt, a decode step
or a continuous batch of many sequences' rows.
"""
from __future__ import annotations

import numpy as np

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.contract import DecoderIO, PagedKV, kv_pages
from soma_runtime.architectures.moe import build_moe_ffn, check_expert_shapes
from soma_runtime.architectures.weights import Weights
from soma_runtime.errors import ModelLoadError, RequestError
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.ir.graph import Graph
from soma_runtime.quant import kv


def expected_shapes(cfg: DecoderConfig, head_rows: int | None = None) -> dict[str, tuple[int, ...]]:
    """The shape every decoder tensor must have, from the config (GGUF-style names, [out, in]); the head
    has `head_rows` rows (default: the vocabulary; a tensor-parallel rank's share of it)."""
    D, H, KV, hd, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    head_rows = cfg.vocab_size if head_rows is None else head_rows
    q_norm, k_norm = ((H * hd,), (KV * hd,)) if cfg.qk_norm_whole else ((hd,), (hd,))
    shapes = {"token_embd.weight": (cfg.vocab_size, D), "output_norm.weight": (D,), "output.weight": (head_rows, D)}
    for i in range(cfg.num_layers):
        p = f"blk.{i}"
        shapes.update({f"{p}.attn_norm.weight": (D,), f"{p}.attn_q.weight": (H * hd, D), f"{p}.attn_k.weight": (KV * hd, D),
                       f"{p}.attn_v.weight": (KV * hd, D), f"{p}.attn_qkv.weight": ((H + 2 * KV) * hd, D),
                       f"{p}.attn_q.bias": (H * hd,), f"{p}.attn_k.bias": (KV * hd,), f"{p}.attn_v.bias": (KV * hd,),
                       f"{p}.attn_output.weight": (D, H * hd), f"{p}.attn_q_norm.weight": q_norm,
                       f"{p}.attn_k_norm.weight": k_norm,
                       f"{p}.post_attention_norm.weight": (D,), f"{p}.ffn_norm.weight": (D,), f"{p}.post_ffw_norm.weight": (D,),
                       f"{p}.ffn_gate.weight": (F, D), f"{p}.ffn_down.weight": (D, F)})
        shapes[f"{p}.ffn_up.weight"] = (F, D)
    return shapes


def check_shapes(cfg: DecoderConfig, weights: Weights, head_rows: int | None = None) -> None:
    """A tensor whose shape disagrees with the config is a corrupt or mismatched file: say which."""
    for name, want in expected_shapes(cfg, head_rows).items():
        if name not in weights:
            continue
        got = tuple(weights[name].shape)
        if name.endswith("ffn_up.weight") and f"{name[:-len('ffn_up.weight')]}ffn_gate.weight" not in weights:
            want = (2 * want[0], want[1])                      # gate and up fused (phi3)
        if got != want:
            raise ModelLoadError(f"{weights.source}: tensor {name!r} has shape {list(got)}, the config needs {list(want)}")
    if cfg.moe is not None:
        check_expert_shapes(cfg.moe, cfg.hidden_size, cfg.num_layers, weights)


SAMPLE_WIDTH = 64


def as_f32(t):
    return np.asarray(t, dtype=np.float32)


def cache_of(cfg: DecoderConfig, kv_dtype: str) -> PagedKV:
    """The cache a decoder keeps: paged K/V for every layer, in `kv_dtype` (a spec, quant/kv.py);
    RequestError if the spec is malformed or its codecs cannot hold this model's heads."""
    cache = PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tuple(cfg.window(i) for i in range(cfg.num_layers)), kv_dtype)
    try:
        cache.token_bytes()                  # every layer's pages sized: a codec that cannot hold the heads says so
    except ValueError as e:
        raise RequestError(str(e)) from None
    return cache


def build_decoder(cfg: DecoderConfig, weights: Weights, io: DecoderIO, activations: str = "f32", shard=None) -> Graph:
    """The model as plain math; the fuse pass (ir/passes/fuse.py) makes it the graph the kernels run.
    `io` declares the inputs (its cache's dtype is the KV cache's precision); `activations="q8"` lets
    matmuls with block-quantized weights quantize their inputs as llama.cpp does (see the matmul op).
    With a `shard` (shard.py), `cfg` and `weights` are one tensor-parallel rank's: the attention output
    and MLP down products are summed over the ranks, each rank's vocabulary rows of the logits joined."""
    check_shapes(cfg, weights, None if shard is None else len(shard.vocab))
    g = GraphBuilder()
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    step = io.declare(g)
    att = step.attention                # causal attention, windowed or not, sees a contiguous span of its context
    made, rotation = {}, kv.rotation(hd)       # the basis the tq KV codecs code vectors in (quant/kv.py)

    def kv_basis():
        """The rotation as a graph constant, one for the model."""
        if "kv_rotation" not in made:
            made["kv_rotation"] = g.const("kv_rotation", rotation)
        return made["kv_rotation"]

    def const(name, f32=False):
        """A weight as a graph constant, once however often it is read (tied embeddings, shared norms)."""
        if (name, f32) not in made:
            made[name, f32] = g.const(name, as_f32(weights[name]) if f32 else weights[name])
        return made[name, f32]

    def linear(x, name, summed=False):
        y = g.matmul(x, const(f"{name}.weight"), transpose_b=True, activations=activations)
        if step.lora is not None and name in step.lora.factors:      # before the bias: DoRA scales the product alone
            a, b, magnitude = step.lora.factors[name]
            y = g.lora_apply(y, x, a, b, step.lora.index, step.lora.scale, magnitude)
        if summed and shard is not None:         # a row-parallel product: each rank holds a part of the sum
            y = g.all_reduce(y)
        return g.add(y, const(f"{name}.bias", f32=True)) if f"{name}.bias" in weights else y

    def norm(x, name):
        return g.rmsnorm(x, const(f"{name}.weight", f32=True), eps=cfg.rms_norm_eps)

    def mlp(h, p):
        if f"{p}.ffn_gate.weight" in weights:
            gate, up = linear(h, f"{p}.ffn_gate"), linear(h, f"{p}.ffn_up")
        else:                                                    # gate and up in one matrix (phi3)
            gate, up = g.split(linear(h, f"{p}.ffn_up"), sizes=(cfg.intermediate_size,) * 2, axis=-1)
        return g.swiglu(gate, up) if cfg.activation == "silu" else g.geglu(gate, up, approximate="tanh")

    def block_output(y, post_norm):
        return norm(y, post_norm) if cfg.sandwich_norms else y

    if io.first:
        x = g.embedding(const("token_embd.weight"), step.ids)
        if x.dtype != "f32":
            x = g.cast(x, dtype="f32")
        if cfg.embed_scale != 1.0:
            x = g.mul(x, g.const("embed_scale", np.full(1, cfg.embed_scale, np.float32)))
    else:                                         # a later part of a split model: the rows its earlier part gave
        x = step.hidden
    pages_out, copies_out = [], []
    for i in io.layers:
        p = f"blk.{i}"
        k_pages, v_pages = kv_pages(step.pages, i - io.layers.start)
        k_copies, v_copies = kv_pages(step.copies, i - io.layers.start)
        h = norm(x, f"{p}.attn_norm")
        if f"{p}.attn_qkv.weight" in weights:
            q, k, v = g.split(linear(h, f"{p}.attn_qkv"), sizes=(H * hd, KV * hd, KV * hd), axis=-1)
        else:
            q, k, v = (linear(h, f"{p}.attn_{n}") for n in "qkv")
        if cfg.qk_norm and cfg.qk_norm_whole:
            q, k = norm(q, f"{p}.attn_q_norm"), norm(k, f"{p}.attn_k_norm")
        q, k, v = (g.reshape(t, shape=("S", n, hd)) for t, n in ((q, H), (k, KV), (v, KV)))
        if cfg.qk_norm and not cfg.qk_norm_whole:
            q, k = norm(q, f"{p}.attn_q_norm"), norm(k, f"{p}.attn_k_norm")
        inv_freq = cfg.inv_freq(i)
        if "rope_freqs.weight" in weights:            # llama-3 GGUF: scaling stored as per-dim factors
            inv_freq = inv_freq / as_f32(weights["rope_freqs.weight"])
        freqs = g.const(f"{p}.inv_freq", inv_freq.astype(np.float32))
        q, k = (g.rope(t, att.positions, freqs, style=cfg.rope_style) for t in (q, k))
        k_codec, v_codec = io.cache.codec(i, 0), io.cache.codec(i, 1)
        if kv.rotated(k_codec):                # <qR, kR> = <q, k>: keys coded in the rotated basis
            q, k = g.matmul(q, kv_basis()), g.matmul(k, kv_basis())
            center = io.cache.key_center(i)
            if center is not None:             # about their center (PagedKV.key_center): softmax sees the same scores
                k = g.sub(k, g.const(f"{p}.key_center", center @ rotation))
        if kv.rotated(v_codec):
            v = g.matmul(v, kv_basis())
        k_pages = g.kv_append(k_pages, k, att.slots, **coded(codec=k_codec))
        v_pages = g.kv_append(v_pages, v, att.slots, **coded(codec=v_codec))
        pages_out += [k_pages, v_pages]
        spans = att.spans[cfg.window(i)]
        if k_copies is not None:              # f16 copies of the sinks and each row's window, read instead of codes
            k_copies, v_copies = g.kv_append(k_copies, k, att.copy_written, None, None, v_copies, v)
            copies_out += [k_copies, v_copies]
            attn = g.paged_attention_copies(q, k_pages, v_pages, att.ctx_slots, spans, k_copies, v_copies, att.copy_slots,
                                            scale=cfg.score_scale(), softcap=cfg.attn_softcap, k_codec=k_codec, v_codec=v_codec,
                                            sinks=io.cache.layout.sinks, window=io.cache.layout.window)
        else:
            attn = g.paged_attention(q, k_pages, v_pages, att.ctx_slots, None, spans, scale=cfg.score_scale(),
                                     softcap=cfg.attn_softcap, **coded(k_codec=k_codec, v_codec=v_codec))
        if kv.rotated(v_codec):             # sum p vR = (sum p v) R: back from the values' rotated basis
            attn = g.matmul(attn, kv_basis(), transpose_b=True)
        attn = linear(g.reshape(attn, shape=("S", H * hd)), f"{p}.attn_output", True)
        x = g.add(x, block_output(attn, f"{p}.post_attention_norm"))
        h = norm(x, f"{p}.ffn_norm")
        if cfg.moe is not None and cfg.moe.routes(i):
            y = build_moe_ffn(g, cfg.moe, h, p, const, linear, activations)
        else:
            y = linear(mlp(h, p), f"{p}.ffn_down", True)
        x = g.add(x, block_output(y, f"{p}.post_ffw_norm"))
    if not io.last:
        return io.outputs(g, pages_out, hidden=x, copies=copies_out)
    rows = g.embedding(x, step.logit_rows)            # the rows that sample a token: the head reads only those
    head = "token_embd" if cfg.tie_embeddings or "output.weight" not in weights else "output"
    logits = linear(norm(rows, "output_norm"), head)
    if shard is not None:                             # this rank's vocabulary rows, in place among the others'
        logits = g.all_reduce(g.pad(logits, pads=((0, 0), (shard.vocab.start, cfg.vocab_size - shard.vocab.stop))))
    if cfg.final_softcap:
        cap = cfg.final_softcap
        logits = g.mul(g.tanh(g.mul(logits, g.const("softcap_inv", np.full(1, 1 / cap, np.float32)))),
                       g.const("softcap", np.full(1, cap, np.float32)))
    return io.outputs(g, pages_out, logits, g.sample(logits, step.sampling, width=sample_width(cfg)), copies=copies_out)


def coded(**codecs) -> dict:
    """An op's codec attrs, those of a float cache ("none") left out."""
    return {name: c for name, c in codecs.items() if c != "none"}


def sample_width(cfg: DecoderConfig) -> int:
    """The candidates the graph's sampler sees: enough for llama.cpp's and HF's default top-k (40, 50)."""
    return min(SAMPLE_WIDTH, cfg.vocab_size)


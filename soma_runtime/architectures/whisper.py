"""Whisper, the encoder-decoder template: WhisperConfig + HF-named weights -> two Graphs.

Encoder: log-mel features [B, mels, frames] -> conv1d (k3) + gelu -> conv1d (k3, stride 2) + gelu ->
+ learned (sinusoid-initialized) positions -> N x (layernorm, attention, add; layernorm, gelu mlp, add)
-> layernorm: [B, frames / 2, D]. Decoder: token ids [B, S] + positions -> N x (layernorm, causal
self-attention, add; layernorm, attention over the encoder's output, add; layernorm, gelu mlp, add) ->
layernorm -> logits through the tied token embedding [B, S, vocab]. Pre-norm, biases everywhere but the
key projections. `build_encoder`/`build_decoder` are the plain math over whole inputs; `build_step` is the
decoder the runner steps (self-attention over paged K/V, cross-attention over K/V that `build_cross`
writes once per input), its inputs and outputs the contract's EncoderDecoderIO.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from soma_runtime.architectures.contract import EncoderDecoderIO, PagedKV, kv_pages
from soma_runtime.architectures.weights import Weights
from soma_runtime.errors import ModelLoadError
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.ir.graph import Graph
from soma_runtime.quant import quantize


@dataclass(frozen=True)
class WhisperConfig:
    vocab_size: int
    d_model: int
    encoder_layers: int
    encoder_heads: int
    encoder_ffn: int
    decoder_layers: int
    decoder_heads: int
    decoder_ffn: int
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    max_target_positions: int = 448

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> WhisperConfig:
        names = {"vocab_size": "vocab_size", "d_model": "d_model", "encoder_layers": "encoder_layers",
                 "encoder_heads": "encoder_attention_heads", "encoder_ffn": "encoder_ffn_dim",
                 "decoder_layers": "decoder_layers", "decoder_heads": "decoder_attention_heads",
                 "decoder_ffn": "decoder_ffn_dim", "num_mel_bins": "num_mel_bins",
                 "max_source_positions": "max_source_positions", "max_target_positions": "max_target_positions"}
        values = {}
        for ours, theirs in names.items():
            value = hf.get(theirs, cls.__dataclass_fields__[ours].default)
            if type(value) is not int or value < 1:
                raise ModelLoadError(f"{source}: {theirs} must be a positive integer, got {value!r}")
            values[ours] = value
        for heads in ("encoder_heads", "decoder_heads"):
            if values["d_model"] % values[heads]:
                raise ModelLoadError(f"{source}: d_model {values['d_model']} is not a multiple of {heads} {values[heads]}")
        if hf.get("activation_function", "gelu") != "gelu" or hf.get("scale_embedding", False):
            raise ModelLoadError(f"{source}: only gelu activations without embedding scaling are whisper's")
        return cls(**values)


class Blocks:
    """The layers both halves share, over one GraphBuilder and the HF-named weights. With activations "q8"
    the projections' weights are q8_0 and their inputs quantized as llama.cpp does (CTranslate2's int8)."""

    def __init__(self, g: GraphBuilder, weights: Weights, d_model: int, activations: str = "f32"):
        self.g, self.weights, self.d_model, self.activations = g, weights, d_model, activations
        self.made: dict[tuple[str, bool], object] = {}

    def const(self, name: str, quantized: bool = False):
        """A weight as a graph constant, once however often it is read (the tied token embedding)."""
        if (name, quantized) not in self.made:
            t = np.asarray(self.weights[name], np.float32)
            self.made[name, quantized] = self.g.const(f"{name}.q8_0", quantize(t, "q8_0")) if quantized else self.g.const(name, t)
        return self.made[name, quantized]

    def project(self, x, name: str):
        """x @ weights[name].T, in the precision asked for."""
        q8 = self.activations == "q8" and self.weights[name].shape[-1] % 32 == 0
        return self.g.matmul(x, self.const(name, q8), transpose_b=True, activations="q8" if q8 else "f32")

    def linear(self, x, name: str):
        y = self.project(x, f"{name}.weight")
        return self.g.add(y, self.const(f"{name}.bias")) if f"{name}.bias" in self.weights else y

    def norm(self, x, name: str):
        return self.g.layernorm(x, self.const(f"{name}.weight"), self.const(f"{name}.bias"), eps=1e-5)

    def heads_first(self, x, rows: str | int, heads: int):    # [B, rows, D] -> [B, H, rows, hd]
        return self.g.transpose(self.g.reshape(x, shape=("B", rows, heads, self.d_model // heads)), dim0=1, dim1=2)

    def attention(self, x, memory, name: str, rows: str | int, keys: str | int, heads: int, causal: bool, scores=None):
        """Multi-head attention; with a list `scores`, its raw scaled q.k scores [B, H, rows, keys] are
        appended to it (the product spelled out rather than one sdpa)."""
        q = self.heads_first(self.linear(x, f"{name}.q_proj"), rows, heads)
        k = self.heads_first(self.linear(memory, f"{name}.k_proj"), keys, heads)
        v = self.heads_first(self.linear(memory, f"{name}.v_proj"), keys, heads)
        if scores is None:
            out = self.g.sdpa(q, k, v, causal=causal)
        else:
            scale = self.g.const(f"{name}.scale", np.full(1, (self.d_model // heads) ** -0.5, np.float32))
            scores.append(self.g.mul(self.g.matmul(q, self.g.transpose(k, dim0=2, dim1=3)), scale))
            out = self.g.matmul(self.g.softmax(scores[-1], causal=causal), v)
        out = self.g.transpose(out, dim0=1, dim1=2)
        return self.linear(self.g.reshape(out, shape=("B", rows, self.d_model)), f"{name}.out_proj")

    def cached_attention(self, x, name: str, k_pages, v_pages, ctx_slots, spans, heads: int):
        """Rows [S, D] attend over cached keys/values (their context's slots, each row its span)."""
        q = self.g.reshape(self.linear(x, f"{name}.q_proj"), shape=("S", heads, self.d_model // heads))
        out = self.g.paged_attention(q, k_pages, v_pages, ctx_slots, None, spans)
        return self.linear(self.g.reshape(out, shape=("S", self.d_model)), f"{name}.out_proj")

    def heads(self, x, name: str, rows: str, heads: int):   # [rows, D] -> [rows, H, hd]
        return self.g.reshape(self.linear(x, name), shape=(rows, heads, self.d_model // heads))

    def mlp(self, x, p: str):
        return self.linear(self.g.gelu(self.linear(x, f"{p}.fc1"), approximate="none"), f"{p}.fc2")


def build_encoder(cfg: WhisperConfig, weights: Weights, activations: str = "f32") -> Graph:
    """features [B, mels, 2 * max_source_positions] -> encoded [B, max_source_positions, D]."""
    g = GraphBuilder()
    b = Blocks(g, weights, cfg.d_model, activations)
    features = g.input("features", ("B", cfg.num_mel_bins, 2 * cfg.max_source_positions), "f32")
    e = "model.encoder"
    x = g.gelu(g.conv1d(features, b.const(f"{e}.conv1.weight"), b.const(f"{e}.conv1.bias"), padding=1), approximate="none")
    x = g.gelu(g.conv1d(x, b.const(f"{e}.conv2.weight"), b.const(f"{e}.conv2.bias"), stride=2, padding=1), approximate="none")
    x = g.add(g.transpose(x, dim0=1, dim1=2), b.const(f"{e}.embed_positions.weight"))
    for i in range(cfg.encoder_layers):
        p = f"{e}.layers.{i}"
        h = b.norm(x, f"{p}.self_attn_layer_norm")
        frames = cfg.max_source_positions
        x = g.add(x, b.attention(h, h, f"{p}.self_attn", frames, frames, cfg.encoder_heads, causal=False))
        x = g.add(x, b.mlp(b.norm(x, f"{p}.final_layer_norm"), p))
    return g.output(b.norm(x, f"{e}.layer_norm"))


def build_decoder(cfg: WhisperConfig, weights: Weights, alignment_heads: tuple[tuple[int, int], ...] = ()) -> Graph:
    """ids, positions [B, S] and encoded [B, T, D] -> logits [B, S, vocab] (each row attends to the
    rows before it and to all of `encoded`); with `alignment_heads` ((layer, head) pairs), also their raw
    cross-attention scores [B, heads, S, T], which word timestamps align text to audio with."""
    g = GraphBuilder()
    b = Blocks(g, weights, cfg.d_model)
    ids = g.input("ids", ("B", "S"), "i64")
    positions = g.input("positions", ("B", "S"), "i64")
    encoded = g.input("encoded", ("B", "T", cfg.d_model), "f32")
    d = "model.decoder"
    tokens = b.const(f"{d}.embed_tokens.weight")
    x = g.add(g.embedding(tokens, g.reshape(ids, shape=(-1,))), g.embedding(b.const(f"{d}.embed_positions.weight"),
                                                                            g.reshape(positions, shape=(-1,))))
    x = g.reshape(x, shape=("B", "S", cfg.d_model))
    aligned = []
    for i in range(cfg.decoder_layers):
        p = f"{d}.layers.{i}"
        h = b.norm(x, f"{p}.self_attn_layer_norm")
        x = g.add(x, b.attention(h, h, f"{p}.self_attn", "S", "S", cfg.decoder_heads, causal=True))
        heads = [head for layer, head in alignment_heads if layer == i]
        scores = [] if heads else None
        x = g.add(x, b.attention(b.norm(x, f"{p}.encoder_attn_layer_norm"), encoded, f"{p}.encoder_attn", "S", "T",
                                 cfg.decoder_heads, causal=False, scores=scores))
        aligned += [g.slice(scores[0], axis=1, start=head, stop=head + 1) for head in heads]
        x = g.add(x, b.mlp(b.norm(x, f"{p}.final_layer_norm"), p))
    logits = g.matmul(b.norm(x, f"{d}.layer_norm"), tokens, transpose_b=True)
    return g.output(logits, g.concat(*aligned, axis=1)) if aligned else g.output(logits)


def caches_of(cfg: WhisperConfig, dtype: str = "f32") -> EncoderDecoderIO:
    """The decoder's self cache and its cross cache: paged K/V of every layer, whole-context."""
    hd = cfg.d_model // cfg.decoder_heads
    cache = PagedKV(cfg.decoder_layers, cfg.decoder_heads, hd, (0,) * cfg.decoder_layers, dtype)
    return EncoderDecoderIO(cache, cache)


def build_cross(cfg: WhisperConfig, weights: Weights, io: EncoderDecoderIO, activations: str = "f32") -> Graph:
    """encoded rows [F, D] and their cross slots [F] -> the cross pages with every decoder layer's
    cross-attention keys and values of those rows written."""
    g = GraphBuilder()
    b = Blocks(g, weights, cfg.d_model, activations)
    encoded, slots, pages = io.declare_cross(g, cfg.d_model)
    out = []
    for i in range(cfg.decoder_layers):
        p = f"model.decoder.layers.{i}.encoder_attn"
        k, v = (b.heads(encoded, f"{p}.{n}_proj", "F", cfg.decoder_heads) for n in "kv")
        k_pages, v_pages = kv_pages(pages, i)
        out += [g.kv_append(k_pages, k, slots), g.kv_append(v_pages, v, slots)]
    return g.output(*out)


def build_step(cfg: WhisperConfig, weights: Weights, io: EncoderDecoderIO, activations: str = "f32") -> Graph:
    """The decoder over its caches: rows [S] of any number of sequences (each its positions, its slots
    and spans) -> logits [R, vocab] of the wanted rows, and the self pages with the rows' K/V appended."""
    g = GraphBuilder()
    b = Blocks(g, weights, cfg.d_model, activations)
    s = io.declare(g)
    att, H, d = s.step.attention, cfg.decoder_heads, "model.decoder"
    tokens = b.const(f"{d}.embed_tokens.weight")
    x = g.add(g.embedding(tokens, s.step.ids), g.embedding(b.const(f"{d}.embed_positions.weight"), att.positions))
    pages_out = []
    for i in range(cfg.decoder_layers):
        p = f"{d}.layers.{i}"
        h = b.norm(x, f"{p}.self_attn_layer_norm")
        k, v = (b.heads(h, f"{p}.self_attn.{n}_proj", "S", H) for n in "kv")
        k_cache, v_cache = kv_pages(s.step.pages, i)
        k_pages, v_pages = g.kv_append(k_cache, k, att.slots), g.kv_append(v_cache, v, att.slots)
        pages_out += [k_pages, v_pages]
        x = g.add(x, b.cached_attention(h, f"{p}.self_attn", k_pages, v_pages, att.ctx_slots, att.spans[0], H))
        h = b.norm(x, f"{p}.encoder_attn_layer_norm")
        x = g.add(x, b.cached_attention(h, f"{p}.encoder_attn", *kv_pages(s.cross_pages, i),
                                        s.cross_slots, s.cross_spans, H))
        x = g.add(x, b.mlp(b.norm(x, f"{p}.final_layer_norm"), p))
    rows = g.embedding(x, s.step.logit_rows)
    return g.output(b.project(b.norm(rows, f"{d}.layer_norm"), f"{d}.embed_tokens.weight"), *pages_out)

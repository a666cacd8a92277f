"""Transformer encoder templates: EncoderConfig + weights -> one Graph.

BERT family (bert, roberta, xlm-roberta): embed (token + position + token type, layernorm) ->
N x (attention, add & layernorm, gelu mlp, add & layernorm), post-norm. ModernBERT: embed
(token, layernorm) -> N x (layernorm, attention with rope, global or local, add; layernorm,
GeGLU mlp, add) -> final layernorm, pre-norm and bias-free. Outputs hidden states [B, S, D], or a
task head's logits: sequence classification (BERT: pooler dense + tanh on [CLS]; RoBERTa: dense
+ tanh; ModernBERT: cls or mean pooling, dense + gelu + layernorm) or token classification.
Graph inputs: `ids`, `positions`, `types` [B, S], additive key masks [B, 1, 1, S] (`mask`) and,
for local attention, [B, 1, S, S] (`mask_local`), and `token_mask` [B, S, 1] for mean pooling.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.architectures.config import rope_inv_freq
from soma_runtime.architectures.decoder import Weights
from soma_runtime.errors import ModelLoadError, UnsupportedModelError
from soma_runtime.ir.graph import Graph, GraphBuilder


@dataclass(frozen=True)
class EncoderFamily:
    model_type: str
    position_offset: str = "none"     # "none": positions 0..S-1; "padding": RoBERTa's pad_id + 1 + index
    head: str = "pooler"              # sequence head: "pooler" (BERT) or "dense" (RoBERTa's classifier.dense)


FAMILIES = {f.model_type: f for f in [
    EncoderFamily("bert"),
    EncoderFamily("roberta", position_offset="padding", head="dense"),
    EncoderFamily("xlm-roberta", position_offset="padding", head="dense"),
    EncoderFamily("modernbert", head="modernbert"),
]}
NOT_YET = ("deberta-v2",)                   # encoder families the registry names but no template has yet


def is_encoder(model_type: str | None) -> bool:
    return model_type in FAMILIES or model_type in NOT_YET


@dataclass
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    gelu: str = "none"                       # "none" (erf) | "tanh"
    pad_token_id: int = 0
    position_offset: str = "none"
    sequence_head: str = "pooler"            # pooler | dense | modernbert
    labels: dict[int, str] = field(default_factory=dict)
    # ModernBERT
    rope_theta: float = 0.0                  # > 0: rotary positions instead of a position table
    local_rope_theta: float = 0.0
    layer_windows: tuple[int, ...] = ()      # per layer: 0 = global attention, w = |i - j| <= w
    classifier_pooling: str = "cls"

    @property
    def modern(self) -> bool:
        return self.sequence_head == "modernbert"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_tokens(self) -> int:
        """Longest input the position table allows."""
        return self.max_position - (self.pad_token_id + 1 if self.position_offset == "padding" else 0)

    def positions(self, mask: np.ndarray) -> np.ndarray:
        """Position ids for a padded batch (mask [B, S] of 1 for tokens), as the HF model computes them."""
        index = np.broadcast_to(np.arange(mask.shape[1]), mask.shape)
        if self.position_offset == "padding":
            return np.where(mask > 0, np.cumsum(mask, axis=1) + self.pad_token_id, self.pad_token_id).astype(np.int64)
        return index.astype(np.int64)


GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def modernbert_config(hf: dict) -> EncoderConfig:
    every, half = hf.get("global_attn_every_n_layers", 3), hf.get("local_attention", 128) // 2
    types = hf.get("layer_types") or ["sliding_attention" if i % every else "full_attention" for i in range(hf["num_hidden_layers"])]
    rope = hf.get("rope_parameters") or {}
    act = hf.get("hidden_activation", "gelu")
    if act not in GELU:
        raise UnsupportedModelError(f"modernbert: hidden_activation {act!r} is not supported (gelu variants only)")
    return EncoderConfig(
        model_type="modernbert", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
        max_position=hf.get("max_position_embeddings", 8192), type_vocab_size=0, layer_norm_eps=hf.get("norm_eps", 1e-5),
        gelu=GELU[act], pad_token_id=hf.get("pad_token_id", 0) or 0, sequence_head="modernbert",
        labels={int(k): v for k, v in (hf.get("id2label") or {}).items()},
        rope_theta=(rope.get("full_attention") or {}).get("rope_theta", hf.get("global_rope_theta", 160000.0)),
        local_rope_theta=(rope.get("sliding_attention") or {}).get("rope_theta", hf.get("local_rope_theta", 10000.0)),
        layer_windows=tuple(half if t == "sliding_attention" else 0 for t in types),
        classifier_pooling=hf.get("classifier_pooling", "cls"))


def encoder_config_from_hf(hf: dict) -> EncoderConfig:
    model_type = hf.get("model_type")
    if model_type in NOT_YET:
        raise UnsupportedModelError(f"encoder model_type {model_type!r} is not supported yet; supported encoders: "
                                    f"{', '.join(sorted(FAMILIES))}")
    if model_type == "modernbert":
        return modernbert_config(hf)
    family = FAMILIES[model_type]
    act = hf.get("hidden_act", "gelu")
    if act not in GELU:
        raise UnsupportedModelError(f"{model_type}: hidden_act {act!r} is not supported (gelu variants only)")
    labels = {int(k): v for k, v in (hf.get("id2label") or {}).items()}
    return EncoderConfig(
        model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"], max_position=hf.get("max_position_embeddings", 512),
        type_vocab_size=hf.get("type_vocab_size", 2), layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        gelu=GELU[act], pad_token_id=hf.get("pad_token_id", 0) or 0, position_offset=family.position_offset,
        sequence_head=family.head, labels=labels)


# --- tensor names: HF -> short canonical names -----------------------------------------------

HF_NAMES = [
    (r"embeddings\.word_embeddings\.weight", "tok_embd.weight"),
    (r"embeddings\.position_embeddings\.weight", "pos_embd.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "type_embd.weight"),
    (r"embeddings\.LayerNorm\.(weight|bias)", r"embd_norm.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)", r"blk.\1.attn_norm.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"blk.\1.ffn_up.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"blk.\1.ffn_down.\2"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", r"blk.\1.ffn_norm.\2"),
    (r"pooler\.dense\.(weight|bias)", r"pooler.\1"),
    (r"classifier\.dense\.(weight|bias)", r"pooler.\1"),           # RoBERTa's head: same role as BERT's pooler
    (r"classifier\.out_proj\.(weight|bias)", r"classifier.\1"),
    (r"classifier\.(weight|bias)", r"classifier.\1"),
    # ModernBERT
    (r"embeddings\.tok_embeddings\.weight", "tok_embd.weight"),
    (r"embeddings\.norm\.(weight|bias)", r"embd_norm.\1"),
    (r"layers\.(\d+)\.attn_norm\.(weight|bias)", r"blk.\1.attn_norm.\2"),
    (r"layers\.(\d+)\.attn\.Wqkv\.(weight|bias)", r"blk.\1.attn_qkv.\2"),
    (r"layers\.(\d+)\.attn\.Wo\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"layers\.(\d+)\.mlp_norm\.(weight|bias)", r"blk.\1.ffn_norm.\2"),
    (r"layers\.(\d+)\.mlp\.Wi\.(weight|bias)", r"blk.\1.ffn_up.\2"),
    (r"layers\.(\d+)\.mlp\.Wo\.(weight|bias)", r"blk.\1.ffn_down.\2"),
    (r"final_norm\.(weight|bias)", r"output_norm.\1"),
    (r"head\.dense\.(weight|bias)", r"pooler.\1"),
    (r"head\.norm\.(weight|bias)", r"head_norm.\1"),
]
PATTERNS = [(re.compile(p + "$"), repl) for p, repl in HF_NAMES]
PREFIXES = ("bert.", "roberta.", "xlm_roberta.", "model.")


def canonical_encoder_weights(tensors: dict) -> dict:
    out = {}
    for name, t in tensors.items():
        for prefix in PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        for pattern, repl in PATTERNS:
            if pattern.match(name):
                out[pattern.sub(repl, name)] = t
                break
    return out


def check_encoder_shapes(cfg: EncoderConfig, weights: Weights) -> None:
    D, F = cfg.hidden_size, cfg.intermediate_size
    want = {"tok_embd.weight": (cfg.vocab_size, D), "embd_norm.weight": (D,)}
    if not cfg.modern:
        want["pos_embd.weight"] = (cfg.max_position, D)
    for i in range(cfg.num_layers):
        if cfg.modern:
            want.update({f"blk.{i}.attn_qkv.weight": (3 * D, D), f"blk.{i}.attn_output.weight": (D, D),
                         f"blk.{i}.ffn_up.weight": (2 * F, D)})
        else:
            want.update({f"blk.{i}.attn_{n}.weight": (D, D) for n in ("q", "k", "v", "output")})
            want[f"blk.{i}.ffn_up.weight"] = (F, D)
        want[f"blk.{i}.ffn_down.weight"] = (D, F)
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"{weights.source}: tensor {name!r} has shape {list(weights[name].shape)}, "
                                 f"the config needs {list(shape)}")


def build_encoder(cfg: EncoderConfig, weights: Weights, head: str | None = None) -> Graph:
    """Hidden states [B, S, D] (head None), or the logits of a "sequence" [B, labels] or "token"
    [B, S, labels] head."""
    g = GraphBuilder()
    H, hd, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    ids = g.input("ids", ("B", "S"), "i64")
    positions = g.input("positions", ("B", "S"), "i64")
    types = g.input("types", ("B", "S"), "i64")
    mask = g.input("mask", ("B", 1, 1, "S"), "f32")

    def const(name):
        t = weights[name]
        return g.const(name, np.asarray(t, dtype=np.float32) if t.ndim == 1 else t)

    def linear(x, name):
        y = g.matmul(x, const(f"{name}.weight"), transpose_b=True)
        return g.add(y, const(f"{name}.bias")) if f"{name}.bias" in weights else y

    def norm(x, name):
        bias = const(f"{name}.bias") if f"{name}.bias" in weights else None
        return g.layernorm(x, const(f"{name}.weight"), bias, eps=cfg.layer_norm_eps)

    def heads_first(x):                              # [B, S, D] -> [B, H, S, hd]
        return g.transpose(g.reshape(x, shape=("B", "S", H, hd)), dim0=1, dim1=2)

    if cfg.modern:
        return modernbert_body(g, cfg, weights, head, ids, positions, mask, const, linear, norm)
    x = g.add(g.embedding(const("tok_embd.weight"), ids), g.embedding(const("pos_embd.weight"), positions))
    if "type_embd.weight" in weights:
        x = g.add(x, g.embedding(const("type_embd.weight"), types))
    x = norm(x, "embd_norm")
    for i in range(cfg.num_layers):
        p = f"blk.{i}"
        q, k, v = (heads_first(linear(x, f"{p}.attn_{n}")) for n in "qkv")
        attn = g.reshape(g.transpose(g.sdpa(q, k, v, mask), dim0=1, dim1=2), shape=("B", "S", D))
        x = norm(g.add(x, linear(attn, f"{p}.attn_output")), f"{p}.attn_norm")
        h = g.gelu(linear(x, f"{p}.ffn_up"), approximate=cfg.gelu)
        x = norm(g.add(x, linear(h, f"{p}.ffn_down")), f"{p}.ffn_norm")
    if head is None:
        return g.output(x)
    if head == "token":
        return g.output(linear(x, "classifier"))
    first = g.reshape(g.slice(x, axis=1, start=0, stop=1), shape=("B", D))      # the [CLS] / <s> token
    return g.output(linear(g.tanh(linear(first, "pooler")), "classifier"))


def modernbert_body(g, cfg: EncoderConfig, weights: Weights, head, ids, positions, mask, const, linear, norm) -> Graph:
    H, hd, D, F = cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    local = g.input("mask_local", ("B", 1, "S", "S"), "f32") if any(cfg.layer_windows) else None
    freqs = {w: g.const(f"inv_freq_{'local' if w else 'global'}",
                        rope_inv_freq({"rope_theta": cfg.local_rope_theta if w else cfg.rope_theta}, hd))
             for w in set(cfg.layer_windows)}
    x = norm(g.embedding(const("tok_embd.weight"), ids), "embd_norm")
    for i, window in enumerate(cfg.layer_windows):
        p = f"blk.{i}"
        h = norm(x, f"{p}.attn_norm") if f"{p}.attn_norm.weight" in weights else x     # layer 0 has none
        q, k, v = g.split(g.reshape(linear(h, f"{p}.attn_qkv"), shape=("B", "S", 3 * H, hd)), sizes=(H, H, H), axis=2)
        q, k = (g.rope(t, positions, freqs[window], style="neox") for t in (q, k))
        q, k, v = (g.transpose(t, dim0=1, dim1=2) for t in (q, k, v))
        attn = g.reshape(g.transpose(g.sdpa(q, k, v, local if window else mask), dim0=1, dim1=2), shape=("B", "S", D))
        x = g.add(x, linear(attn, f"{p}.attn_output"))
        up, gate = g.split(linear(norm(x, f"{p}.ffn_norm"), f"{p}.ffn_up"), sizes=(F, F), axis=-1)
        x = g.add(x, linear(g.geglu(up, gate, approximate=cfg.gelu), f"{p}.ffn_down"))
    x = norm(x, "output_norm")
    if head is None:
        return g.output(x)

    def predict(t):                                   # ModernBertPredictionHead: dense, gelu, layernorm
        return norm(g.gelu(linear(t, "pooler"), approximate="none"), "head_norm")

    if head == "token":
        return g.output(linear(predict(x), "classifier"))
    if cfg.classifier_pooling == "mean":
        tokens = g.input("token_mask", ("B", "S", 1), "f32")
        pooled = g.div(g.reshape(g.matmul(g.transpose(tokens, dim0=1, dim1=2), x), shape=("B", D)),
                       g.reshape(g.matmul(g.transpose(tokens, dim0=1, dim1=2), tokens), shape=("B", 1)))
    else:
        pooled = g.reshape(g.slice(x, axis=1, start=0, stop=1), shape=("B", D))
    return g.output(linear(predict(pooled), "classifier"))

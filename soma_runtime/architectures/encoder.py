"""Transformer encoder templates: EncoderConfig + weights -> one Graph.

BERT family (bert, roberta, xlm-roberta): embed (token + position + token type, layernorm) ->
N x (attention, add & layernorm, gelu mlp, add & layernorm), post-norm. DeBERTa-v2/v3: the same
layers, with disentangled attention: each score also gets content-to-position and
position-to-content terms read from a table of (log-bucketed) relative distances. ModernBERT: embed
(token, layernorm) -> N x (layernorm, attention with rope, global or local, add; layernorm,
GeGLU mlp, add) -> final layernorm, pre-norm and bias-free. Outputs hidden states [B, S, D], or a
task head's logits: sequence classification (BERT: pooler dense + tanh on [CLS]; RoBERTa: dense
+ tanh; DeBERTa: dense + gelu; ModernBERT: cls or mean pooling, dense + gelu + layernorm) or token classification.
A graph's inputs and output are declared once, by its EncoderIO (encoder_io), which the runner asks.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.architectures.config import rope_inv_freq
from soma_runtime.architectures.fields import ENCODER_FIELDS, check_fields, reading
from soma_runtime.architectures.weights import Weights
from soma_runtime.dtypes import dtype, dtype_of
from soma_runtime.errors import ModelLoadError, RequestError, UnsupportedModelError
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.ir.graph import Graph


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
    EncoderFamily("deberta-v2"),
]}


def is_encoder(model_type) -> bool:
    return isinstance(model_type, str) and model_type in FAMILIES


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
    # DeBERTa-v2: disentangled attention over relative distances
    pos_att: tuple[str, ...] = ()            # "c2p" (content to position), "p2c" (position to content)
    att_span: int = 0                        # distances index rows [0, 2 * span) of the relative table
    position_buckets: int = 0                # > 0: distances past half of this share log-spaced buckets
    max_relative_positions: int = 0
    share_att_key: bool = False              # the relative table goes through the q/k projections
    position_biased_input: bool = True       # an absolute position table is added to the embeddings
    pooler_act: str = "tanh"

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

    def relative_columns(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """DeBERTa's [S, S] columns into the relative scores: content-to-position for (query i, key j)
        and position-to-content for (key j, query i), as the HF model computes them."""
        index = np.arange(length)
        distance = index[:, None] - index[None, :]
        if self.position_buckets > 0 and self.max_relative_positions > 0:
            distance = log_buckets(distance, self.position_buckets, self.max_relative_positions)
        span = self.att_span
        return np.clip(distance + span, 0, 2 * span - 1), np.clip(-distance + span, 0, 2 * span - 1)


@dataclass(frozen=True)
class EncoderIO:
    """An encoder graph's inputs and output, declared once: the template builds these inputs and the
    runner feeds them. Always `ids`, `positions`, `types` [B, S] and the additive key mask `mask`
    [B, 1, 1, S]; `mask_local` [B, 1, S, S] where some layers attend locally; `token_mask` [B, S, 1] where
    the sequence head mean-pools; DeBERTa's relative-distance columns `rel_c2p`, `rel_p2c` [B, H, S, S]
    (EncoderConfig.relative_columns). The one output: hidden states [B, S, D] (head None), a "sequence"
    head's logits [B, labels] or a "token" head's [B, S, labels]."""
    head: str | None
    local_mask: bool
    token_mask: bool
    relative: tuple[str, ...]

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("ids", "positions", "types", "mask", *(("mask_local",) if self.local_mask else ()),
                *(("token_mask",) if self.token_mask else ()), *(f"rel_{term}" for term in self.relative))


def encoder_io(cfg: EncoderConfig, head: str | None) -> EncoderIO:
    """The inputs and output of `cfg`'s graph with `head` (build_encoder)."""
    sequence = head is not None and head != "token"
    return EncoderIO(head, local_mask=cfg.modern and any(cfg.layer_windows),
                     token_mask=cfg.modern and sequence and cfg.classifier_pooling == "mean",
                     relative=() if cfg.modern else cfg.pos_att)


def log_buckets(distance: np.ndarray, buckets: int, max_position: int) -> np.ndarray:
    """DeBERTa's make_log_bucket_position, in f32 like the reference (its ceil decides the bucket)."""
    mid = buckets // 2
    magnitude = np.where((distance < mid) & (distance > -mid), mid - 1, np.abs(distance))
    ratio = np.log(magnitude.astype(np.float32) / np.float32(mid)) / np.log(np.float32((max_position - 1) / mid))
    log_position = np.ceil(ratio * np.float32(mid - 1)) + mid
    return np.where(magnitude <= mid, distance, log_position * np.sign(distance)).astype(np.int64)


GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def modernbert_config(hf: dict) -> EncoderConfig:
    every, half = hf.get("global_attn_every_n_layers", 3), hf.get("local_attention", 128) // 2
    types = hf.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                      for i in range(hf["num_hidden_layers"])]
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


def deberta_config(hf: dict) -> EncoderConfig:
    if hf.get("conv_kernel_size", 0) > 0:
        raise UnsupportedModelError("deberta-v2: the convolution layer (conv_kernel_size > 0, deberta-v2-xlarge) "
                                    "is not supported")
    if hf.get("embedding_size", hf["hidden_size"]) != hf["hidden_size"]:
        raise UnsupportedModelError("deberta-v2: an embedding_size other than hidden_size is not supported")
    pos_att = hf.get("pos_att_type") or []
    if isinstance(pos_att, str):
        pos_att = [x.strip() for x in pos_att.lower().split("|")]
    for name, act in (("hidden_act", hf.get("hidden_act", "gelu")), ("pooler_hidden_act", hf.get("pooler_hidden_act", "gelu"))):
        if act not in GELU:
            raise UnsupportedModelError(f"deberta-v2: {name} {act!r} is not supported (gelu variants only)")
    max_position = hf.get("max_position_embeddings", 512)
    relative = hf.get("relative_attention", False)
    max_relative = hf.get("max_relative_positions", -1)
    max_relative = max_relative if max_relative >= 1 else max_position
    buckets = hf.get("position_buckets", -1)
    return EncoderConfig(
        model_type="deberta-v2", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
        max_position=max_position, type_vocab_size=hf.get("type_vocab_size", 0), layer_norm_eps=hf.get("layer_norm_eps", 1e-7),
        gelu=GELU[hf.get("hidden_act", "gelu")], pad_token_id=hf.get("pad_token_id", 0) or 0,
        labels={int(k): v for k, v in (hf.get("id2label") or {}).items()},
        pos_att=tuple(x for x in ("c2p", "p2c") if x in pos_att) if relative else (),
        att_span=(buckets if buckets > 0 else max_relative) if relative else 0,
        position_buckets=buckets if relative else 0, max_relative_positions=max_relative if relative else 0,
        share_att_key=hf.get("share_att_key", False), position_biased_input=hf.get("position_biased_input", True),
        pooler_act="gelu" if GELU[hf.get("pooler_hidden_act", "gelu")] == "none" else "gelu_tanh")





def encoder_config_from_hf(hf: dict, source: str = "config.json") -> EncoderConfig:
    """An EncoderConfig from a HF config.json dict, its fields checked first."""
    check_fields(hf, ENCODER_FIELDS, source)
    hf = {k: v for k, v in hf.items() if v is not None}           # null means unset in HF configs
    with reading(source):
        cfg = encoder_config(hf)
    problems = [(cfg.hidden_size % cfg.num_heads == 0,
                 f"hidden_size {cfg.hidden_size} is not a multiple of {cfg.num_heads} heads"),
                (cfg.pad_token_id < cfg.vocab_size, f"pad_token_id {cfg.pad_token_id} is outside the vocabulary"),
                (cfg.max_tokens >= 1, "no room for a token in the position table"),
                (all(w >= 0 for w in cfg.layer_windows), "attention windows must be >= 0")]
    for ok, message in problems:
        if not ok:
            raise ModelLoadError(f"{source}: {message}")
    return cfg


def encoder_config(hf: dict) -> EncoderConfig:
    model_type = hf.get("model_type")
    if model_type == "modernbert":
        return modernbert_config(hf)
    if model_type == "deberta-v2":
        return deberta_config(hf)
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
    # DeBERTa-v2
    (r"encoder\.layer\.(\d+)\.attention\.self\.query_proj\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key_proj\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value_proj\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.pos_key_proj\.(weight|bias)", r"blk.\1.attn_pos_k.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.pos_query_proj\.(weight|bias)", r"blk.\1.attn_pos_q.\2"),
    (r"encoder\.rel_embeddings\.weight", "rel_embd.weight"),
    (r"encoder\.LayerNorm\.(weight|bias)", r"rel_norm.\1"),
]
PATTERNS = [(re.compile(p + "$"), repl) for p, repl in HF_NAMES]
PREFIXES = ("bert.", "roberta.", "xlm_roberta.", "deberta.", "model.")


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


def matmul_weights_in(weights: Weights, precision: str) -> Weights:
    """The weights with every 2-D projection (not the embedding tables) stored as `precision`:
    "f32" keeps them as loaded; "bf16" halves them and lets the matmuls run on bf16 inputs."""
    if precision == "f32":
        return weights
    if precision != "bf16":
        raise RequestError(f"an encoder's activations are f32 or bf16, got {precision!r}")
    bf16 = dtype("bf16").numpy
    return Weights({name: np.asarray(t).astype(bf16) if np.ndim(t) == 2 and "embd" not in name else t
                    for name, t in weights.tensors.items()}, weights.source)


def check_encoder_shapes(cfg: EncoderConfig, weights: Weights) -> None:
    D, F = cfg.hidden_size, cfg.intermediate_size
    want = {"tok_embd.weight": (cfg.vocab_size, D), "embd_norm.weight": (D,)}
    if not cfg.modern and cfg.position_biased_input:
        want["pos_embd.weight"] = (cfg.max_position, D)
    if cfg.pos_att:
        want["rel_embd.weight"] = (2 * cfg.att_span, D)
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


class Layers:
    """The pieces every transformer-encoder template is built of, over one GraphBuilder and one model's weights
    (canonical names): constants (1-D ones as f32), linear layers (bf16 weights take bf16 activations, as
    transformers runs them), layernorms, multi-head self-attention and the gelu MLP. The BERT family, ModernBERT
    and ViT (vit.py) read their layers through it; `length` is the sequence axis ("S", or a fixed count)."""

    def __init__(self, g: GraphBuilder, weights: Weights, heads: int, head_dim: int, eps: float, length="S"):
        self.g, self.weights, self.heads, self.head_dim, self.eps, self.length = g, weights, heads, head_dim, eps, length

    def const(self, name):
        t = self.weights[name]
        return self.g.const(name, np.asarray(t, dtype=np.float32) if t.ndim == 1 else t)

    def linear(self, x, name):
        w = self.weights[f"{name}.weight"]
        y = self.g.matmul(x, self.const(f"{name}.weight"), transpose_b=True,
                          activations="bf16" if dtype_of(w) == "bf16" else "f32")
        return self.g.add(y, self.const(f"{name}.bias")) if f"{name}.bias" in self.weights else y

    def norm(self, x, name):
        bias = self.const(f"{name}.bias") if f"{name}.bias" in self.weights else None
        return self.g.layernorm(x, self.const(f"{name}.weight"), bias, eps=self.eps)

    def heads_first(self, x):                        # [B, S, D] -> [B, H, S, hd]
        return self.g.transpose(self.g.reshape(x, shape=("B", self.length, self.heads, self.head_dim)), dim0=1, dim1=2)

    def qkv(self, x, p: str):
        """The layer's queries, keys and values (separate q, k, v projections), heads first."""
        return tuple(self.heads_first(self.linear(x, f"{p}.attn_{n}")) for n in "qkv")

    def attend(self, q, k, v, p: str, bias=None, scale=None, precision: str = "f32"):
        """sdpa over heads, the heads merged back to [B, S, D] and through the layer's output projection."""
        g = self.g
        out = g.transpose(g.sdpa(q, k, v, bias, scale=scale, precision=precision), dim0=1, dim1=2)
        return self.linear(g.reshape(out, shape=("B", self.length, self.heads * self.head_dim)), f"{p}.attn_output")

    def mlp(self, x, p: str, approximate: str = "none"):
        """The feed-forward block: up projection, gelu, down projection."""
        return self.linear(self.g.gelu(self.linear(x, f"{p}.ffn_up"), approximate=approximate), f"{p}.ffn_down")


def build_encoder(cfg: EncoderConfig, weights: Weights, head: str | None = None, precision: str = "f32") -> Graph:
    """Hidden states [B, S, D] (head None), or the logits of a "sequence" [B, labels] or "token"
    [B, S, labels] head. `precision` "bf16" lets attention's products take bf16 inputs (the
    projections follow their weights' dtype: see matmul_weights_in)."""
    g, io = GraphBuilder(), encoder_io(cfg, head)
    D = cfg.hidden_size
    ids = g.input("ids", ("B", "S"), "i64")
    positions = g.input("positions", ("B", "S"), "i64")
    types = g.input("types", ("B", "S"), "i64")
    mask = g.input("mask", ("B", 1, 1, "S"), "f32")
    layers = Layers(g, weights, cfg.num_heads, cfg.head_dim, cfg.layer_norm_eps)
    const, linear, norm = layers.const, layers.linear, layers.norm
    if cfg.modern:
        return modernbert_body(g, cfg, io, weights, ids, positions, mask, layers, precision)
    x = g.embedding(const("tok_embd.weight"), ids)
    if cfg.position_biased_input:
        x = g.add(x, g.embedding(const("pos_embd.weight"), positions))
    if "type_embd.weight" in weights:
        x = g.add(x, g.embedding(const("type_embd.weight"), types))
    x = norm(x, "embd_norm")
    relative = RelativeScores(g, cfg, io.relative, weights, linear, norm) if io.relative else None
    for i in range(cfg.num_layers):
        p = f"blk.{i}"
        q, k, v = layers.qkv(x, p)
        bias, scale = (mask, None) if relative is None else relative(p, q, k, mask)
        x = norm(g.add(x, layers.attend(q, k, v, p, bias, scale, precision)), f"{p}.attn_norm")
        x = norm(g.add(x, layers.mlp(x, p, cfg.gelu)), f"{p}.ffn_norm")
    if head is None:
        return g.output(x)
    if head == "token":
        return g.output(linear(x, "classifier"))
    first = g.reshape(g.slice(x, axis=1, start=0, stop=1), shape=("B", D))      # the [CLS] / <s> token
    pooled = linear(first, "pooler")
    if cfg.pooler_act == "tanh":
        pooled = g.tanh(pooled)
    else:
        pooled = g.gelu(pooled, approximate="tanh" if cfg.pooler_act == "gelu_tanh" else "none")
    return g.output(linear(pooled, "classifier"))


class RelativeScores:
    """DeBERTa's disentangled attention terms, folded into the additive mask of each layer's sdpa.

    The relative table (layer-normed) goes through each layer's position projections, a constant the
    plan folds; the per-(query, key) columns come in as inputs. Content and both relative terms
    share one scale, 1 / sqrt(head_dim * (1 + number of relative terms))."""

    def __init__(self, g, cfg: EncoderConfig, terms: tuple[str, ...], weights: Weights, linear, norm):
        self.g, self.cfg, self.linear = g, cfg, linear
        table = g.const("rel_embd.weight", np.asarray(weights["rel_embd.weight"], np.float32))
        self.table = norm(table, "rel_norm") if "rel_norm.weight" in weights else table
        shape = ("B", cfg.num_heads, "S", "S")
        self.columns = {term: g.input(f"rel_{term}", shape, "i64") for term in terms}
        self.scale = 1 / math.sqrt(cfg.head_dim * (1 + len(terms)))
        self.scale_const = g.const("rel_scale", np.full(1, self.scale, np.float32))

    def heads(self, name: str):
        """[2 span, D] table through a projection -> [1, H, 2 span, head_dim]."""
        g, cfg = self.g, self.cfg
        rows = g.reshape(self.linear(self.table, name), shape=(1, 2 * cfg.att_span, cfg.num_heads, cfg.head_dim))
        return g.transpose(rows, dim0=1, dim1=2)

    def __call__(self, p: str, q, k, mask):
        g, shared = self.g, self.cfg.share_att_key
        bias = mask
        if "c2p" in self.columns:                 # query content against key's relative position
            keys = self.heads(f"{p}.attn_k" if shared else f"{p}.attn_pos_k")
            c2p = g.gather(g.matmul(q, keys, transpose_b=True), self.columns["c2p"], axis=-1)
            bias = g.add(bias, g.mul(c2p, self.scale_const))
        if "p2c" in self.columns:                 # key content against query's relative position
            queries = self.heads(f"{p}.attn_q" if shared else f"{p}.attn_pos_q")
            p2c = g.gather(g.matmul(k, queries, transpose_b=True), self.columns["p2c"], axis=-1)
            bias = g.add(bias, g.mul(g.transpose(p2c, dim0=2, dim1=3), self.scale_const))
        return bias, self.scale


def modernbert_body(g, cfg: EncoderConfig, io: EncoderIO, weights: Weights, ids, positions, mask, layers: Layers,
                    precision: str) -> Graph:
    H, hd, D, F = cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    const, linear, norm = layers.const, layers.linear, layers.norm
    local = g.input("mask_local", ("B", 1, "S", "S"), "f32") if io.local_mask else None
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
        x = g.add(x, layers.attend(q, k, v, p, local if window else mask, precision=precision))
        up, gate = g.split(linear(norm(x, f"{p}.ffn_norm"), f"{p}.ffn_up"), sizes=(F, F), axis=-1)
        x = g.add(x, linear(g.geglu(up, gate, approximate=cfg.gelu), f"{p}.ffn_down"))
    x = norm(x, "output_norm")
    if io.head is None:
        return g.output(x)

    def predict(t):                                   # ModernBertPredictionHead: dense, gelu, layernorm
        return norm(g.gelu(linear(t, "pooler"), approximate="none"), "head_norm")

    if io.head == "token":
        return g.output(linear(predict(x), "classifier"))
    if io.token_mask:
        tokens = g.input("token_mask", ("B", "S", 1), "f32")
        pooled = g.div(g.reshape(g.matmul(g.transpose(tokens, dim0=1, dim1=2), x), shape=("B", D)),
                       g.reshape(g.matmul(g.transpose(tokens, dim0=1, dim1=2), tokens), shape=("B", 1)))
    else:
        pooled = g.reshape(g.slice(x, axis=1, start=0, stop=1), shape=("B", D))
    return g.output(linear(predict(pooled), "classifier"))

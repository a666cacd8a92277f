"""Vision transformers: ViT and DeiT (HF model_type "vit", "deit"): VitConfig + weights -> one Graph from pixels
[B, C, H, W] to the [CLS] embedding and, where the checkpoint has a classifier, its logits.

Patch embedding (a conv2d whose kernel and stride are the patch size), the [CLS] token (and DeiT's distillation
token) before the patches, learned position embeddings at the configured image size (other sizes are refused:
transformers' interpolate_pos_encoding is not reproduced), N pre-norm layers (layernorm_before, self-attention with
q/k/v biases, add; layernorm_after, gelu MLP, add), the final layernorm. A module of its own because nothing of the
BERT family's config or embeddings applies (no vocabulary, pre-norm), while its layers are encoder.Layers' (the
same linear layers, norms, attention and MLP).

Outputs, in this order: "embedding" [B, D], the [CLS] token's hidden state after the final layernorm (ViTModel's
last_hidden_state[:, 0]; a ViTModel checkpoint's pooler, dense + tanh, is not applied), and where the checkpoint
has a classifier "logits" [B, labels]: ViT's and DeiT's classifier on [CLS], DeiT-with-teacher's mean of its [CLS]
and distillation heads.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.architectures.encoder import GELU, Layers
from soma_runtime.architectures.fields import EPSILON, HEADS, LAYERS, OPTIONAL_SIZE, SIZE, Field, check_fields, reading
from soma_runtime.architectures.weights import Weights
from soma_runtime.errors import ModelLoadError, UnsupportedModelError
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.ir.graph import Graph

SPECIAL_TOKENS = {"vit": 1, "deit": 2}          # [CLS]; DeiT's [CLS] and distillation token
VIT_FIELDS = {"hidden_size": SIZE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "intermediate_size": SIZE,
              "patch_size": OPTIONAL_SIZE, "num_channels": Field(int, 1, 64), "layer_norm_eps": EPSILON}
OUTPUTS = ("embedding", "logits")


def is_vit(model_type) -> bool:
    return isinstance(model_type, str) and model_type in SPECIAL_TOKENS


@dataclass(frozen=True)
class VitConfig:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    image_size: tuple[int, int]
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-12
    gelu: str = "none"                       # "none" (erf) | "tanh"
    qkv_bias: bool = True
    labels: dict[int, str] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def tokens(self) -> int:
        """Special tokens before the patches."""
        return SPECIAL_TOKENS[self.model_type]

    @property
    def grid(self) -> tuple[int, int]:
        """Patches down and across (the convolution's output: a partial patch at an edge is dropped)."""
        return self.image_size[0] // self.patch_size, self.image_size[1] // self.patch_size

    @property
    def length(self) -> int:
        return self.tokens + self.grid[0] * self.grid[1]

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> VitConfig:
        check_fields(hf, VIT_FIELDS, source)
        hf = {k: v for k, v in hf.items() if v is not None}
        with reading(source):
            size = hf.get("image_size", 224)
            size = (size, size) if isinstance(size, int) and not isinstance(size, bool) else tuple(size)
            if len(size) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1 << 16 for n in size):
                raise ModelLoadError(f"{source}: image_size must be an integer or [height, width], got {hf['image_size']!r}")
            act = hf.get("hidden_act", "gelu")
            if act not in GELU:
                raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (gelu variants only)")
            cfg = cls(model_type=hf["model_type"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                      num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"], image_size=size,
                      patch_size=hf.get("patch_size", 16), num_channels=hf.get("num_channels", 3),
                      layer_norm_eps=hf.get("layer_norm_eps", 1e-12), gelu=GELU[act], qkv_bias=hf.get("qkv_bias", True),
                      labels={int(k): str(v) for k, v in (hf.get("id2label") or {}).items()})
        if cfg.hidden_size % cfg.num_heads:
            raise ModelLoadError(f"{source}: hidden_size {cfg.hidden_size} is not a multiple of {cfg.num_heads} heads")
        if min(cfg.grid) < 1:
            raise ModelLoadError(f"{source}: image_size {list(size)} holds no patch of {cfg.patch_size}")
        return cfg


# --- tensor names: HF -> canonical names (the encoder's, where the role is the same) -----------------

HF_NAMES = [
    (r"embeddings\.cls_token", "cls_token"),
    (r"embeddings\.distillation_token", "dist_token"),
    (r"embeddings\.position_embeddings", "pos_embd"),
    (r"embeddings\.patch_embeddings\.projection\.(weight|bias)", r"patch_embd.\1"),
    (r"encoder\.layer\.(\d+)\.layernorm_before\.(weight|bias)", r"blk.\1.attn_norm.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.attention\.query\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.attention\.key\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.attention\.value\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"encoder\.layer\.(\d+)\.layernorm_after\.(weight|bias)", r"blk.\1.ffn_norm.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"blk.\1.ffn_up.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"blk.\1.ffn_down.\2"),
    (r"layernorm\.(weight|bias)", r"output_norm.\1"),
    (r"classifier\.(weight|bias)", r"classifier.\1"),
    (r"cls_classifier\.(weight|bias)", r"classifier.\1"),              # DeiT with teacher: its [CLS] head
    (r"distillation_classifier\.(weight|bias)", r"dist_classifier.\1"),
]
PATTERNS = [(re.compile(p + "$"), repl) for p, repl in HF_NAMES]
PREFIXES = ("vit.", "deit.")
FLOAT32 = ("cls_token", "dist_token", "pos_embd", "patch_embd.weight", "patch_embd.bias")   # added to f32 pixels' sums


def canonical_vit_weights(tensors: dict) -> dict:
    out = {}
    for name, t in tensors.items():
        name = next((name[len(p):] for p in PREFIXES if name.startswith(p)), name)
        for pattern, repl in PATTERNS:
            if pattern.match(name):
                key = pattern.sub(repl, name)
                out[key] = np.asarray(t, np.float32) if key in FLOAT32 else t
                break
    return out


def check_vit_shapes(cfg: VitConfig, weights: Weights) -> None:
    D, F, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    want = {"patch_embd.weight": (D, cfg.num_channels, p, p), "cls_token": (1, 1, D), "pos_embd": (1, cfg.length, D),
            "output_norm.weight": (D,)}
    if cfg.tokens == 2:
        want["dist_token"] = (1, 1, D)
    for i in range(cfg.num_layers):
        want.update({f"blk.{i}.attn_{n}.weight": (D, D) for n in ("q", "k", "v", "output")})
        want.update({f"blk.{i}.ffn_up.weight": (F, D), f"blk.{i}.ffn_down.weight": (D, F)})
    if "classifier.weight" in weights:
        want["classifier.weight"] = (weights["classifier.weight"].shape[0], D)
        if "dist_classifier.weight" in weights:
            want["dist_classifier.weight"] = want["classifier.weight"]
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            hint = " (position embeddings are for the configured image_size and patch_size)" if name == "pos_embd" else ""
            raise ModelLoadError(f"{weights.source}: tensor {name!r} has shape {list(weights[name].shape)}, "
                                 f"the config needs {list(shape)}{hint}")


def token_table(cfg: VitConfig, weights: Weights) -> np.ndarray:
    """[1, length, D]: the position embeddings with the special tokens added to their rows, in f32 as transformers
    adds them (cat(special, patches) + positions); the patches' rows come in as zeros (padding) and get theirs."""
    table = np.array(weights["pos_embd"], np.float32)
    table[0, 0] += weights["cls_token"][0, 0]
    if cfg.tokens == 2:
        table[0, 1] += weights["dist_token"][0, 0]
    return table


def build_vit(cfg: VitConfig, weights: Weights, precision: str = "f32") -> Graph:
    """pixels [B, C, H, W] (H, W the configured image_size) -> "embedding" [B, D] and, with a classifier,
    "logits" [B, labels]. `precision` "bf16" lets attention's products take bf16 inputs (the projections follow
    their weights' dtype: encoder.matmul_weights_in)."""
    g, D, L = GraphBuilder(), cfg.hidden_size, cfg.length
    layers = Layers(g, weights, cfg.num_heads, cfg.head_dim, cfg.layer_norm_eps, length=L)
    height, width = cfg.image_size
    pixels = g.input("pixels", ("B", cfg.num_channels, height, width), "f32")
    patches = g.conv2d(pixels, layers.const("patch_embd.weight"), layers.const("patch_embd.bias"), stride=cfg.patch_size)
    x = g.transpose(g.reshape(patches, shape=("B", D, L - cfg.tokens)), dim0=1, dim1=2)       # [B, patches, D]
    x = g.pad(x, pads=((0, 0), (cfg.tokens, 0), (0, 0)))
    x = g.add(x, g.const("tokens_and_positions", token_table(cfg, weights)))
    for i in range(cfg.num_layers):
        p = f"blk.{i}"
        q, k, v = layers.qkv(layers.norm(x, f"{p}.attn_norm"), p)
        x = g.add(x, layers.attend(q, k, v, p, precision=precision))
        x = g.add(x, layers.mlp(layers.norm(x, f"{p}.ffn_norm"), p, cfg.gelu))
    special = layers.norm(g.slice(x, axis=1, start=0, stop=cfg.tokens), "output_norm")   # per token: the rest unused
    first = g.reshape(g.slice(special, axis=1, start=0, stop=1), shape=("B", D), name="embedding")
    if "classifier.weight" not in weights:
        return g.output(first)
    logits = layers.linear(first, "classifier")
    if "dist_classifier.weight" in weights:
        second = g.reshape(g.slice(special, axis=1, start=1, stop=2), shape=("B", D))
        half = g.const("half", np.full(1, 0.5, np.float32))
        logits = g.mul(g.add(logits, layers.linear(second, "dist_classifier")), half)
    labels = weights["classifier.weight"].shape[0]
    return g.output(first, g.reshape(logits, shape=("B", labels), name="logits"))

"""DecoderConfig: everything the decoder template needs, read from a HF config.json or GGUF metadata.

One dataclass covers the llama family and its variants; a family differs only in flags (qkv bias,
q/k norm, sandwich norms, soft-capping, sliding windows, rope style). Rope frequencies, including
llama-3 and linear scaling, are computed here once, so the graph only sees `inv_freq` tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from soma_runtime.architectures.fields import HF_FIELDS, ROPE_FIELDS, check_fields, check_token_ids, reading, table
from soma_runtime.architectures.moe import MoEConfig, moe_config_from_hf
from soma_runtime.errors import ModelLoadError, UnsupportedModelError


@dataclass
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int = 4096
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_theta": 10000.0})        # global layers
    rope_local: dict | None = None          # sliding-window layers, when they differ (gemma3)
    rotary_dim: int | None = None           # partial rotary: fewer than head_dim dims rotate
    rope_style: str = "neox"                # neox (HF) | interleaved (GGUF llama, whose q/k are permuted)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False             # q/k norms over all heads at once (OLMoE), not per head
    sandwich_norms: bool = False            # gemma2/3: norms after attention and mlp too
    embed_scale: float = 1.0
    activation: str = "silu"                # silu | gelu_tanh
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    attn_scale: float | None = None         # default 1/sqrt(head_dim)
    layer_windows: tuple[int, ...] = ()     # per layer: 0 = full attention, else sliding window
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None            # routed experts in place of the MLP (moe.py)

    def validate(self, source: str) -> DecoderConfig:
        """ModelLoadError, naming `source`, for fields that disagree with each other."""
        problems = [
            (self.vocab_size >= 1, "no vocabulary (vocab_size, or the tokenizer's tokens)"),
            (self.num_heads % self.num_kv_heads == 0,
             f"{self.num_heads} attention heads cannot share {self.num_kv_heads} kv heads"),
            (self.rotary_dim is None or 2 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0,
             f"the rotary dims ({self.rotary_dim}) must be even and at most the head dim ({self.head_dim})"),
            (self.head_dim % 2 == 0, f"the head dim ({self.head_dim}) must be even for rotary positions"),
            (not self.layer_windows or len(self.layer_windows) == self.num_layers, "a window per layer"),
            (all(w >= 0 for w in self.layer_windows), "sliding windows must be >= 0"),
            (rope_attention_factor(self.rope) == 1.0 or self.rotary_dim is None,
             "YaRN with partial rotary dims is not supported"),
        ]
        for ok, message in problems:
            if not ok:
                raise ModelLoadError(f"{source}: {message}")
        check_token_ids(self.bos_token_id, self.vocab_size, "bos_token_id", source)
        check_token_ids(list(self.eos_token_ids), self.vocab_size, "eos_token_id", source)
        for rope in (self.rope, self.rope_local):
            if rope is not None:
                try:
                    self.inv_freq_of(rope)
                except ModelLoadError as e:
                    raise ModelLoadError(f"{source}: {e}") from None
        return self

    def inv_freq_of(self, rope: dict) -> np.ndarray:
        return rope_inv_freq(rope, self.rotary_dim or self.head_dim)

    def at_context(self, n_ctx: int) -> DecoderConfig:
        """This config run with a context of `n_ctx` tokens: dynamic NTK's frequencies are those of that
        length (HF's for a sequence that long; the same for every token, so cached keys stay valid)."""
        def at(rope: dict | None) -> dict | None:
            return {**rope, "context": n_ctx} if rope is not None and rope_kind(rope) == "dynamic" else rope
        return replace(self, rope=at(self.rope), rope_local=at(self.rope_local))

    def score_scale(self) -> float:
        """What q.k is multiplied by: 1/sqrt(head_dim) unless the model says otherwise, times the square of
        YaRN's attention factor (it scales q and k as they turn)."""
        base = self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5
        return base * rope_attention_factor(self.rope) ** 2

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def inv_freq(self, layer: int) -> np.ndarray:
        return self.inv_freq_of(self.rope_local if self.rope_local is not None and self.window(layer) else self.rope)


def rope_inv_freq(rope: dict, dim: int) -> np.ndarray:
    """Rotary frequencies for `dim` rotated dims, as HF computes them (default, linear, dynamic, llama3, yarn)."""
    kind = rope_kind(rope)
    if kind not in ROPE_FIELDS:
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_FIELDS)})")
    check_fields(rope, ROPE_FIELDS[kind], "rope parameters")
    theta = rope["rope_theta"]
    if kind == "dynamic":            # NTK-aware: the base stretched to the context's length, past the original one
        factor, original = rope["factor"], rope["original_max_position_embeddings"]
        length = max(rope.get("context", original), original)
        theta = theta * (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    if kind in ("default", "dynamic"):
        return inv.astype(np.float32)
    if kind == "linear":
        return (inv / rope["factor"]).astype(np.float32)
    if kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_ctx = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if kind == "yarn":               # high frequencies kept, low ones interpolated, a linear ramp between
        low, high = yarn_ramp(rope, dim)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
        return (inv / rope["factor"] * ramp + inv * (1 - ramp)).astype(np.float32)
    raise AssertionError(kind)


def yarn_ramp(rope: dict, dim: int) -> tuple[float, float]:
    """YaRN's correction range: the dims that turn beta_fast and beta_slow times over the original context."""
    base, original = rope["rope_theta"], rope["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_of(rope.get("beta_fast", 32)), dim_of(rope.get("beta_slow", 1))
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rope_kind(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def rope_context(rope: dict, max_position: int) -> int:
    """The positions a model runs to: its own, or for dynamic NTK (whose config keeps the original) that
    stretched by the factor."""
    return int(max_position * rope["factor"]) if rope_kind(rope) == "dynamic" else max_position


def rope_attention_factor(rope: dict) -> float:
    """YaRN's scale on the rotated queries and keys (1 for the other kinds): HF's attention_factor."""
    if rope_kind(rope) != "yarn":
        return 1.0
    if "attention_factor" in rope:
        return rope["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    factor = rope["factor"]
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
    return mscale(factor)


def _eos(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _hf_rope(hf: dict, source: str) -> tuple[dict, dict | None]:
    params = table(hf, "rope_parameters", source)
    if not params:
        params = {"rope_theta": hf.get("rope_theta", 10000.0), **table(hf, "rope_scaling", source)}
        local = {"rope_theta": hf["rope_local_base_freq"]} if "rope_local_base_freq" in hf else None
        return params, local
    if "full_attention" in params:          # per layer type (gemma3)
        return table(params, "full_attention", source), table(params, "sliding_attention", source) or None
    return params, None


def with_original_context(rope: dict, hf: dict) -> dict:
    """YaRN's and dynamic NTK's original context defaults to the model's (as HF reads it)."""
    if rope_kind(rope) in ("yarn", "dynamic") and "original_max_position_embeddings" not in rope:
        return {**rope, "original_max_position_embeddings": hf.get("max_position_embeddings", 4096)}
    return rope


def _layer_windows(hf: dict, n_layers: int) -> tuple[int, ...]:
    window = hf.get("sliding_window") or 0
    if not window or hf.get("use_sliding_window") is False:
        return ()
    types = hf.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window,) * n_layers


def config_from_hf(hf: dict, model_type: str, traits: dict, source: str = "config.json") -> DecoderConfig:
    """A DecoderConfig from a HF config.json dict; `traits` are the family's registry flags."""
    check_fields(hf, HF_FIELDS, source)
    hf = {k: v for k, v in hf.items() if v is not None}           # null means unset in HF configs
    with reading(source):
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        rope, rope_local = _hf_rope(hf, source)
        rope = with_original_context(rope, hf)
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        scalar = hf.get("query_pre_attn_scalar")
        n_layers = hf["num_hidden_layers"]
        return DecoderConfig(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            max_position=rope_context(rope, hf.get("max_position_embeddings", 4096)),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=rope,
            rope_local=rope_local,
            rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
            tie_embeddings=hf.get("tie_word_embeddings", traits.get("tie_embeddings", False)),
            qkv_bias=traits.get("qkv_bias", hf.get("attention_bias", False)),
            qk_norm=traits.get("qk_norm", False),
            qk_norm_whole=traits.get("qk_norm_whole", False),
            sandwich_norms=traits.get("sandwich_norms", False),
            embed_scale=math.sqrt(hf["hidden_size"]) if traits.get("scaled_embeddings") else 1.0,
            activation="gelu_tanh" if "gelu" in (hf.get("hidden_activation") or hf.get("hidden_act") or "silu") else "silu",
            attn_softcap=hf.get("attn_logit_softcapping") or 0.0,
            final_softcap=hf.get("final_logit_softcapping") or 0.0,
            attn_scale=scalar ** -0.5 if scalar else None,
            layer_windows=_layer_windows(hf, n_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos(hf.get("eos_token_id")),
            moe=moe_config_from_hf(hf, traits, source),
        ).validate(source)

"""The architecture registry: model_type -> template, family traits, tensor names, GGUF mapping.

A family is one entry: its traits are flags of the shared decoder template, never a copied file.
Tensor names are canonicalized to GGUF's short names (`blk.3.attn_q.weight`), so the template
reads one naming whatever file the weights came from.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.architectures.config import DecoderConfig, config_from_hf
from soma_runtime.architectures.fields import GGUF_FIELDS, check_fields, reading, table
from soma_runtime.architectures.moe import moe_config_from_gguf, stack_hf_experts
from soma_runtime.errors import ModelLoadError, UnsupportedModelError


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    gguf_arch: str
    traits: dict = field(default_factory=dict)
    template: str = "decoder"
    gguf_rope_style: str = "neox"      # llama.cpp's convert permutes llama q/k rows for interleaved rope
    swa_pattern: int = 0               # GGUF: every n-th layer is global, the rest slide (0 = none)


LLAMA_LIKE = {"tie_embeddings": False}
GEMMA = {"scaled_embeddings": True, "norm_offset": True, "tie_embeddings": True}
ARCHITECTURES: dict[str, ArchSpec] = {s.model_type: s for s in [
    ArchSpec("llama", "llama", LLAMA_LIKE, gguf_rope_style="interleaved"),
    ArchSpec("mistral", "llama", LLAMA_LIKE, gguf_rope_style="interleaved"),
    ArchSpec("qwen2", "qwen2", {"qkv_bias": True}),
    ArchSpec("qwen3", "qwen3", {"qk_norm": True}),
    ArchSpec("phi3", "phi3"),
    ArchSpec("gemma", "gemma", GEMMA),
    ArchSpec("gemma2", "gemma2", {**GEMMA, "sandwich_norms": True}, swa_pattern=2),
    ArchSpec("gemma3_text", "gemma3", {**GEMMA, "sandwich_norms": True, "qk_norm": True}, swa_pattern=6),
    # mixture-of-experts (moe.py): Mixtral's GGUF is llama's, told apart by its experts; "normalize" is the
    # family's own renormalization of the chosen weights where its file does not say (norm_topk_prob)
    ArchSpec("mixtral", "llama", {**LLAMA_LIKE, "moe": {"normalize": True}}, gguf_rope_style="interleaved"),
    ArchSpec("qwen2_moe", "qwen2moe", {"qkv_bias": True, "moe": {}}),
    ArchSpec("qwen3_moe", "qwen3moe", {"qk_norm": True, "moe": {"normalize": True}}),
    ArchSpec("olmoe", "olmoe", {"qk_norm": True, "qk_norm_whole": True, "moe": {}}),
]}
ALIASES = {"gemma3": "gemma3_text"}
BY_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma": "gemma",
                "gemma2": "gemma2", "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
MOE_OF_GGUF_ARCH = {"llama": "mixtral"}      # a dense GGUF architecture whose files with experts are this family


def register(spec: ArchSpec) -> ArchSpec:
    """Add a family: a llama-like model is one entry (its traits are flags of the shared template); a
    GGUF architecture name of its own maps its files to it."""
    ARCHITECTURES[spec.model_type] = spec
    BY_GGUF_ARCH.setdefault(spec.gguf_arch, spec.model_type)
    return spec


def lookup(model_type: str) -> ArchSpec:
    spec = ARCHITECTURES.get(ALIASES.get(model_type, model_type))
    if spec is None:
        raise UnsupportedModelError(f"unknown model_type {model_type!r}; supported: {', '.join(supported())}")
    return spec


def supported() -> list[str]:
    return sorted(set(ARCHITECTURES) | set(ALIASES))


# --- tensor names ------------------------------------------------------------------------------

def permute_for_interleaved_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rotates pairs (i, i + d/2); llama.cpp's llama rope rotates (2i, 2i + 1): reorder the rows."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
SANDWICH_LAYER_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                        "post_feedforward_layernorm": "post_ffw_norm"}
HF_GLOBAL_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}
HF_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)$")


def canonical_hf_name(name: str, spec: ArchSpec) -> str | None:
    """GGUF-style name for a HF tensor name (None for tensors the decoder does not use)."""
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name in HF_GLOBAL_NAMES:
        return HF_GLOBAL_NAMES[name]
    m = HF_LAYER.match(name)
    if not m:
        return None
    layer, module, kind = m.groups()
    names = {**HF_LAYER_NAMES, **SANDWICH_LAYER_NAMES} if spec.traits.get("sandwich_norms") else HF_LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{kind}" if module in names else None


def canonical_hf_weights(tensors: dict, spec: ArchSpec, source: str = "checkpoint") -> dict:
    out, tensors = stack_hf_experts(tensors, source) if "moe" in spec.traits else ({}, tensors)
    for name, t in tensors.items():
        key = canonical_hf_name(name, spec)
        if key is None:
            continue
        if spec.traits.get("norm_offset") and key.endswith("norm.weight"):
            t = t.astype(np.float32) + 1     # HF gemma stores w and scales by (1 + w); GGUF stores 1 + w
        out[key] = t
    return out


# --- configs -----------------------------------------------------------------------------------

def config_for_hf(hf: dict, source: str = "config.json") -> tuple[ArchSpec, DecoderConfig]:
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{source}: expected a table of fields, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if not isinstance(model_type, str):
        raise UnsupportedModelError(f"{source}: no model_type; supported: {', '.join(supported())}")
    spec = lookup(model_type)
    if model_type in ALIASES and "text_config" in hf:
        hf = {**table(hf, "text_config", source), "model_type": spec.model_type}
    return spec, config_from_hf(hf, spec.model_type, spec.traits, source)





def config_for_gguf(meta: dict, tensor_names: set[str], source: str = "GGUF") -> tuple[ArchSpec, DecoderConfig]:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in BY_GGUF_ARCH:
        raise UnsupportedModelError(f"{source}: unknown GGUF architecture {arch!r}; supported: {', '.join(sorted(BY_GGUF_ARCH))}")
    spec = lookup(BY_GGUF_ARCH[arch])
    if arch in MOE_OF_GGUF_ARCH and (meta.get(f"{arch}.expert_count") or "blk.0.ffn_gate_inp.weight" in tensor_names):
        spec = lookup(MOE_OF_GGUF_ARCH[arch])
    check_fields(meta, {f"{arch}.{key}": field for key, field in GGUF_FIELDS.items()}, source)
    with reading(source):
        return spec, gguf_config(spec, arch, meta, tensor_names, source).validate(source)


def gguf_config(spec: ArchSpec, arch: str, meta: dict, tensor_names: set[str], source: str = "GGUF") -> DecoderConfig:
    """GGUF metadata (its fields checked) as a DecoderConfig."""

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length") or hidden // heads
    n_layers = get("block_count")
    rope = {"rope_theta": get("rope.freq_base", 10000.0)}
    if get("rope.scaling.type") == "linear":
        rope.update(rope_type="linear", factor=get("rope.scaling.factor"))
    elif get("rope.scaling.type") == "yarn":          # llama.cpp's keys; its attention factor is YaRN's default
        rope.update(rope_type="yarn", factor=get("rope.scaling.factor"),
                    original_max_position_embeddings=get("rope.scaling.original_context_length") or get("context_length", 4096),
                    **{beta: get(f"rope.scaling.yarn_{beta}") for beta in ("beta_fast", "beta_slow")
                       if get(f"rope.scaling.yarn_{beta}") is not None})
    window = get("attention.sliding_window") or 0
    windows = ()
    if window and spec.swa_pattern:
        windows = tuple(0 if (i + 1) % spec.swa_pattern == 0 else window for i in range(n_layers))
    elif window:
        windows = (window,) * n_layers
    rope_dim = get("rope.dimension_count") or head_dim
    return DecoderConfig(
        model_type=spec.model_type,
        vocab_size=get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv") or heads,
        head_dim=head_dim,
        intermediate_size=get("feed_forward_length"),
        max_position=get("context_length", 4096),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope=rope,
        rope_local={"rope_theta": 10000.0} if spec.model_type == "gemma3_text" else None,
        rotary_dim=rope_dim if rope_dim != head_dim else None,
        rope_style=spec.gguf_rope_style,
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        qk_norm_whole=spec.traits.get("qk_norm_whole", False),
        sandwich_norms="blk.0.post_attention_norm.weight" in tensor_names,
        embed_scale=float(np.sqrt(hidden)) if spec.traits.get("scaled_embeddings") else 1.0,
        activation="gelu_tanh" if spec.model_type.startswith("gemma") else "silu",
        attn_softcap=get("attn_logit_softcapping") or 0.0,
        final_softcap=get("final_logit_softcapping") or 0.0,
        layer_windows=windows,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(t for t in (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"))
                            if t is not None),
        moe=moe_config_from_gguf(meta, arch, tensor_names, spec.traits, n_layers, source),
    )

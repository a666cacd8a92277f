"""Hugging Face directory -> GGUF file (f32, f16, q8_0, q4_0, q4_1), written with the `gguf` package.

Weights go through the same canonicalization as loading (GGUF names, gemma's +1 norms), then take
llama.cpp's conventions: llama/mistral q/k rows permuted for interleaved rope, llama-3 rope scaling
as a `rope_freqs` tensor, routers kept f32 and experts merged per layer (`ffn_*_exps`). The tokenizer is
exported as the `gpt2` (byte-level BPE) kind. PEFT LoRA adapters may be merged into the weights first
(`--merge-lora`), each checked against the base as a run-time load checks it.
"""
from __future__ import annotations

import json
import os

import numpy as np

from soma_runtime.architectures.config import rope_inv_freq
from soma_runtime.architectures.lora import merged
from soma_runtime.architectures.registry import canonical_hf_weights, config_for_hf, permute_for_interleaved_rope
from soma_runtime.architectures.weights import Weights
from soma_runtime.dtypes import QTensor
from soma_runtime.errors import UnsupportedModelError
from soma_runtime.loaders.checkpoint import read_checkpoint
from soma_runtime.loaders.lora import read_peft
from soma_runtime.quant import quantize
from soma_runtime.text.tokenizer import CONTROL, USER_DEFINED, read_json

OUT_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")


def rope_factors(rope: dict, dim: int) -> np.ndarray:
    """llama.cpp stores llama-3 rope scaling as per-dim divisors of the default frequencies."""
    return (rope_inv_freq({"rope_theta": rope["rope_theta"]}, dim) / rope_inv_freq(rope, dim)).astype(np.float32)


KEPT_F32 = ("rope_freqs.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")    # as llama.cpp keeps them


def encode_tensor(name: str, t: np.ndarray, out_type: str):
    """Matrices take the requested type; vectors (norms, biases), routers and odd-shaped rows stay f32."""
    t = np.asarray(t, dtype=np.float32)
    if t.ndim < 2 or out_type == "f32" or name.endswith(KEPT_F32):
        return t
    if out_type == "f16":
        return t.astype(np.float16)
    if t.shape[-1] % 32:
        return t.astype(np.float16)
    return quantize(t, out_type)


def tokenizer_metadata(directory: str) -> dict:
    spec = read_json(os.path.join(directory, "tokenizer.json"))
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise UnsupportedModelError(f"{directory}: only byte-level BPE tokenizers export to GGUF, got {model.get('type')}")
    vocab = dict(model["vocab"])
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    for content, t in added.items():
        vocab[content] = t["id"]
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [1] * size
    for token, i in vocab.items():
        tokens[i] = token
        if token in added:
            types[i] = CONTROL if added[token].get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    config = read_json(os.path.join(directory, "tokenizer_config.json"))

    def token_id(key):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return vocab.get(value) if value else None
    return {"tokens": tokens, "types": types, "merges": merges, "bos": token_id("bos_token"), "eos": token_id("eos_token"),
            "add_bos": bool(config.get("add_bos_token", False)), "chat_template": config.get("chat_template")}


def convert_hf_to_gguf(directory: str, out_path: str, out_type: str = "f16", loras: list[tuple[str, float]] = ()) -> str:
    import gguf
    if out_type not in OUT_TYPES:
        raise ValueError(f"output type must be one of {', '.join(OUT_TYPES)}, got {out_type!r}")
    with open(os.path.join(directory, "config.json")) as f:
        hf = json.load(f)
    spec, cfg = config_for_hf(hf)
    arch = spec.gguf_arch
    tensors = canonical_hf_weights(read_checkpoint(directory), spec)
    for path, alpha in loras:                    # merged into the weights, each checked against the base first
        adapter = read_peft(path, cfg, Weights(tensors, directory), alpha=alpha)
        for module, factors in adapter.modules.items():
            tensors[f"{module}.weight"] = merged(tensors[f"{module}.weight"], factors)
    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(os.path.basename(os.path.normpath(directory)))
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope["rope_theta"])
    w.add_rope_dimension_count(cfg.rotary_dim or cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.attn_softcap:
        w.add_attn_logit_softcapping(cfg.attn_softcap)
    if cfg.final_softcap:
        w.add_final_logit_softcapping(cfg.final_softcap)
    if cfg.layer_windows:
        w.add_sliding_window(max(cfg.layer_windows))
    if cfg.moe is not None:
        w.add_expert_count(cfg.moe.num_experts)
        w.add_expert_used_count(cfg.moe.top_k)
        w.add_expert_feed_forward_length(cfg.moe.expert_size)
        w.add_expert_weights_norm(cfg.moe.normalize)
        if cfg.moe.shared_size:
            w.add_expert_shared_feed_forward_length(cfg.moe.shared_size)
    kind = cfg.rope.get("rope_type", "default")
    if kind == "llama3":
        tensors["rope_freqs.weight"] = rope_factors(cfg.rope, cfg.rotary_dim or cfg.head_dim)
    elif kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope["factor"])
    elif kind == "yarn" and not {"mscale", "mscale_all_dim", "attention_factor"} & set(cfg.rope) and cfg.rope.get("truncate", 1):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope["factor"])
        w.add_rope_scaling_orig_ctx_len(cfg.rope["original_max_position_embeddings"])
        for beta in ("beta_fast", "beta_slow"):
            if beta in cfg.rope:
                getattr(w, f"add_rope_scaling_yarn_{beta}")(cfg.rope[beta])
    elif kind != "default":
        raise UnsupportedModelError(f"rope scaling {kind!r} (with these parameters) cannot be exported to GGUF")
    tok = tokenizer_metadata(directory)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    if tok["bos"] is not None:
        w.add_bos_token_id(tok["bos"])
    if tok["eos"] is not None:
        w.add_eos_token_id(tok["eos"])
    w.add_add_bos_token(tok["add_bos"])
    if tok["chat_template"]:
        w.add_chat_template(tok["chat_template"])
    interleave = spec.gguf_rope_style == "interleaved"
    for name, t in tensors.items():
        if interleave and name.endswith(("attn_q.weight", "attn_q.bias")):
            t = permute_for_interleaved_rope(np.asarray(t, np.float32), cfg.num_heads)
        elif interleave and name.endswith(("attn_k.weight", "attn_k.bias")):
            t = permute_for_interleaved_rope(np.asarray(t, np.float32), cfg.num_kv_heads)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            t = np.asarray(t).reshape(-1)          # llama.cpp's shared-expert gate is a vector, HF's a [1, hidden] matrix
        data = encode_tensor(name, t, out_type)
        if isinstance(data, QTensor):
            w.add_tensor(name, data.data, raw_shape=(*data.shape[:-1], data.data.shape[-1]),
                         raw_dtype=gguf.GGMLQuantizationType(data.dtype.ggml_id))
        else:
            w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path

"""Tiny random-weight HF decoders (one per family) and a tiny BPE tokenizer, built and saved in tests.

The weights are re-drawn with a fixed seed at a scale that keeps the reference's top-2 logit gaps
clear, so greedy decoding is a meaningful comparison.
"""
from __future__ import annotations

import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a tiny tokenizer for tests.",
          "Numbers 12345 and symbols !?#$ appear too.", "Caf\u00e9, na\u00efve, \u00fcber, \u0433\u043e\u0440\u043e\u0434, \u6771\u4eac, \u0645\u0631\u062d\u0628\u0627."] * 20

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
FAMILIES = {
    "llama": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}, "rope_theta": 10000.0},
    "mistral": {"sliding_window": 12},
    "qwen2": {},
    "qwen3": {},
    "phi3": {},
    "gemma": {"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    "gemma2": {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 12, "query_pre_attn_scalar": 20,
                   "attn_logit_softcapping": 5.0, "final_logit_softcapping": 8.0, "tie_word_embeddings": True},
    "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 12, "query_pre_attn_scalar": 16,
                        "tie_word_embeddings": True, "num_hidden_layers": 3,
                        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}}},
}


def build_tokenizer(directory: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML}, f)
    return tok


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.35) -> None:
    """Redraw every weight (biases and norms too, which HF initializes to constants)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise if "gemma" not in type(model).__name__.lower() else 0.2 * noise)
            else:
                fan_in = p.shape[-1] if p.ndim > 1 else 8
                p.copy_(noise * scale * (3.0 / fan_in) ** 0.5 * (4 if "embed" in name else 1))


def build_model(family: str, directory: str, seed: int = 0, dtype=torch.float32, **config):
    """Save a tiny random `family` model (and tokenizer) to `directory`, `config` overriding its sizes;
    returns the HF model (eval, eager)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    os.makedirs(directory, exist_ok=True)
    tok = build_tokenizer(directory)
    overrides = {**BASE, **FAMILIES[family], **config, "vocab_size": tok.get_vocab_size(),
                 "bos_token_id": tok.token_to_id("<|im_start|>"), "eos_token_id": tok.token_to_id("<|im_end|>"),
                 "pad_token_id": tok.token_to_id("<|endoftext|>")}
    config = AutoConfig.for_model(family, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize(model, seed)
    model.to(dtype).save_pretrained(directory)
    return model.float().eval(), tok

"""Hugging Face model directories: config.json, safetensors weights, tokenizer files and
generation_config.json (whose sampling fields become the model's defaults)."""
from __future__ import annotations

import os

from soma_runtime.architectures.decoder import Weights
from soma_runtime.architectures.registry import canonical_hf_weights, config_for_hf
from soma_runtime.errors import ModelLoadError
from soma_runtime.loaders.safetensors import read_checkpoint
from soma_runtime.text.tokenizer import Tokenizer, read_json

SAMPLING_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "repetition_penalty": "repeat_penalty"}


def sampling_defaults(generation_config: dict) -> dict:
    out = {ours: generation_config[theirs] for theirs, ours in SAMPLING_KEYS.items() if theirs in generation_config}
    if generation_config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def load_hf_dir(directory: str):
    from soma_runtime.loaders import LoadedModel
    hf_config = read_json(os.path.join(directory, "config.json"))
    if not hf_config:
        raise ModelLoadError(f"{directory}: config.json is empty")
    spec, cfg = config_for_hf(hf_config)
    weights = Weights(canonical_hf_weights(read_checkpoint(directory), spec), directory)
    generation = read_json(os.path.join(directory, "generation_config.json"))
    if generation.get("eos_token_id") is not None and not cfg.eos_token_ids:
        eos = generation["eos_token_id"]
        cfg.eos_token_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    return LoadedModel(directory, "hf", cfg, weights, Tokenizer.from_hf_dir(directory), sampling_defaults(generation),
                       metadata=hf_config)

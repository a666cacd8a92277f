"""Hugging Face model directories: config.json, safetensors weights, tokenizer files and
generation_config.json (whose sampling fields become the model's defaults)."""
from __future__ import annotations

import os

from soma_runtime.architectures.encoder import canonical_encoder_weights, check_encoder_shapes, encoder_config_from_hf, is_encoder
from soma_runtime.architectures.fields import check_token_ids
from soma_runtime.architectures.pooling import Pooling
from soma_runtime.architectures.registry import canonical_hf_weights, config_for_hf
from soma_runtime.architectures.vit import VitConfig, canonical_vit_weights, check_vit_shapes, is_vit
from soma_runtime.architectures.weights import Weights
from soma_runtime.architectures.whisper import WhisperConfig
from soma_runtime.errors import ModelLoadError, UnsupportedModelError
from soma_runtime.image.preprocess import ImageProcessor
from soma_runtime.loaders.checkpoint import read_checkpoint
from soma_runtime.loaders.model import LoadedModel
from soma_runtime.text.tokenizer import Tokenizer, read_json

SAMPLING_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "repetition_penalty": "repeat_penalty"}


def sampling_defaults(generation_config: dict) -> dict:
    out = {ours: generation_config[theirs] for theirs, ours in SAMPLING_KEYS.items() if theirs in generation_config}
    if generation_config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def load_hf_dir(directory: str):
    config_path = os.path.join(directory, "config.json")
    hf_config = read_json(config_path)
    if not hf_config:
        raise ModelLoadError(f"{config_path}: empty")
    if is_encoder(hf_config.get("model_type")):
        return load_hf_encoder_dir(directory, hf_config)
    if hf_config.get("model_type") == "whisper":
        return load_hf_whisper_dir(directory, hf_config)
    if is_vit(hf_config.get("model_type")):
        return load_hf_vit_dir(directory, hf_config)
    spec, cfg = config_for_hf(hf_config, config_path)
    weights = Weights(canonical_hf_weights(read_checkpoint(directory), spec, directory), directory)
    generation_path = os.path.join(directory, "generation_config.json")
    generation = read_json(generation_path)
    if generation.get("eos_token_id") is not None and not cfg.eos_token_ids:
        eos = generation["eos_token_id"]
        check_token_ids(eos, cfg.vocab_size, "eos_token_id", generation_path)
        cfg.eos_token_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    return LoadedModel(directory, "hf", cfg, weights, Tokenizer.from_hf_dir(directory), sampling_defaults(generation),
                       metadata=hf_config)


def load_hf_encoder_dir(directory: str, hf_config: dict):
    """An encoder directory, with sentence-transformers' pooling, normalization and length limit when
    it carries them (modules.json, 1_Pooling/config.json, sentence_bert_config.json)."""
    cfg = encoder_config_from_hf(hf_config, os.path.join(directory, "config.json"))
    weights = Weights(canonical_encoder_weights(read_checkpoint(directory)), directory)
    check_encoder_shapes(cfg, weights)
    modules = read_json(os.path.join(directory, "modules.json"), list)
    pooling_dir = next((m.get("path", "") for m in modules if m.get("type", "").endswith(".Pooling")), "1_Pooling")
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    pooling = Pooling.from_sentence_transformers(read_json(os.path.join(directory, pooling_dir, "config.json")), normalize)
    limits = [read_json(os.path.join(directory, "sentence_bert_config.json")).get("max_seq_length"),
              read_json(os.path.join(directory, "tokenizer_config.json")).get("model_max_length")]
    max_tokens = min([n for n in limits if isinstance(n, int) and n > 0] + [cfg.max_tokens])
    return LoadedModel(directory, "hf", cfg, weights, Tokenizer.from_hf_dir(directory), metadata=hf_config,
                       pooling=pooling, max_tokens=max_tokens)


def load_hf_whisper_dir(directory: str, hf_config: dict):
    """A whisper directory (WhisperForConditionalGeneration): its weights keep their HF names, which the
    whisper template reads; generation_config.json's suppress lists and alignment heads ride in metadata."""
    cfg = WhisperConfig.from_hf(hf_config, os.path.join(directory, "config.json"))
    weights = Weights({k: v for k, v in read_checkpoint(directory).items() if k.startswith("model.")}, directory)
    generation = read_json(os.path.join(directory, "generation_config.json"))
    return LoadedModel(directory, "hf", cfg, weights, Tokenizer.from_hf_dir(directory), metadata={**hf_config, **generation})


def load_hf_vit_dir(directory: str, hf_config: dict):
    """A ViT or DeiT directory (ViTModel, ViTForImageClassification, DeiTForImageClassification[WithTeacher]) with
    its preprocessor_config.json, whose images must come out at the size the position embeddings were trained at."""
    cfg = VitConfig.from_hf(hf_config, os.path.join(directory, "config.json"))
    weights = Weights(canonical_vit_weights(read_checkpoint(directory)), directory)
    check_vit_shapes(cfg, weights)
    processor_path = os.path.join(directory, "preprocessor_config.json")
    if not os.path.isfile(processor_path):
        raise ModelLoadError(f"{processor_path}: missing; an image model is loaded with its processor's settings "
                             f"(transformers' image_processor.save_pretrained writes them)")
    try:
        processor = ImageProcessor.from_config(read_json(processor_path))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{processor_path}: malformed ({type(e).__name__}: {e})") from None
    size = processor.output_size
    if size != cfg.image_size:
        got = "a size that follows each image" if size is None else f"{list(size)}"
        raise UnsupportedModelError(f"{processor_path}: the processor gives images of {got}, the model's position "
                                    f"embeddings are for {list(cfg.image_size)} (interpolating them is not supported)")
    return LoadedModel(directory, "hf", cfg, weights, None, metadata=hf_config, processor=processor)

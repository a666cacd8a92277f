"""LoRA adapter files read into a LoraAdapter for a given base: PEFT directories (adapter_config.json +
adapter_model.safetensors: rank, lora_alpha with rank_pattern and alpha_pattern per module, rsLoRA's alpha /
sqrt(rank), target modules by names or a regex, DoRA's magnitudes) and llama.cpp's GGUF LoRA files
(`blk.N.attn_q.weight.lora_a`/`.lora_b`, adapter.lora.alpha, rows already in the GGUF base's order).

Owns the file formats and their names; what fits a base is architectures/lora.py's to say. Every
mismatch is a ModelLoadError naming the file and the module or field.
"""
from __future__ import annotations

import math
import os
import re

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.lora import TARGETS, LoraAdapter, check_name, check_rank, check_scale, factors
from soma_runtime.architectures.registry import HF_LAYER_NAMES, canonical_hf_name, lookup
from soma_runtime.architectures.weights import Weights
from soma_runtime.dtypes import QTensor
from soma_runtime.errors import ModelLoadError, UnsupportedModelError
from soma_runtime.loaders.gguf import read_gguf
from soma_runtime.loaders.safetensors import read_safetensors
from soma_runtime.quant import dequantize
from soma_runtime.text.tokenizer import read_json

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
TENSOR = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.(?:lora_(?P<factor>[AB])\.weight|lora_magnitude_vector)$")
UNSUPPORTED = ("modules_to_save", "lora_bias", "fan_in_fan_out", "trainable_token_indices", "layer_replication",
               "target_parameters", "use_qalora", "alora_invocation_tokens")      # options whose meaning is not a plain LoRA
HF_TARGETS = {hf: kind for hf, kind in HF_LAYER_NAMES.items() if kind in TARGETS}
ALL_LINEAR = "all-linear"            # PEFT's name for every linear layer but the head


def base_modules(cfg: DecoderConfig, weights: Weights) -> list[str]:
    """The HF names of the base's modules a LoRA may target (PEFT's, without the wrapper's prefix): its
    linear layers, q/k/v or qkv, gate and up or gate_up, as it has them."""
    modules = []
    for i in range(cfg.num_layers):
        fused_mlp = f"blk.{i}.ffn_gate.weight" not in weights          # ffn_up holds gate and up (phi3)
        modules += [f"model.layers.{i}.{hf}" for hf, kind in HF_TARGETS.items() if f"blk.{i}.{kind}.weight" in weights
                    and (kind != "ffn_up" or (hf == "mlp.gate_up_proj") == fused_mlp)]
    return modules


def pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module override: the value of the first key matching the module name's end."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def check_targets(targets, cfg: DecoderConfig, weights: Weights, where: str) -> None:
    """Each target name must be a module kind of the base (a regex: match one of its modules)."""
    modules = base_modules(cfg, weights)
    if targets == ALL_LINEAR:
        return
    if isinstance(targets, str):
        try:
            found = any(re.fullmatch(targets, m) for m in modules)
        except re.error as e:
            raise ModelLoadError(f"{where}: target_modules is not a valid regex ({e})") from None
        if not found:
            raise ModelLoadError(f"{where}: target_modules {targets!r} matches no module of the base")
        return
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ModelLoadError(f"{where}: target_modules must be a regex or a list of module names, got {targets!r}")
    for t in targets:
        if not any(m == t or m.endswith(f".{t}") for m in modules):
            raise ModelLoadError(f"{where}: target module {t!r} does not exist in the base "
                                 f"(its linear layers: {', '.join(sorted({m.split('.')[-1] for m in modules}))})")


def adapter_name(path, name: str | None = None) -> str:
    """The checked name of the adapter at `path`: `name`, or the directory's (a GGUF file's, less .gguf);
    ModelLoadError for a path that climbs ('..') or a name that is not one."""
    if not isinstance(path, str) or ".." in path.replace("\\", "/").split("/"):
        raise ModelLoadError(f"an adapter path must not contain '..', got {path!r}")
    return check_name(os.path.basename(os.path.normpath(path)).removesuffix(".gguf") if name is None else name)


def read_lora(path: str, cfg: DecoderConfig, weights: Weights, name: str | None = None, alpha: float = 1.0) -> LoraAdapter:
    """The adapter at `path` (a PEFT directory, or a llama.cpp GGUF LoRA file) for this base."""
    return (read_gguf_lora if os.path.isfile(path) else read_peft)(path, cfg, weights, name, alpha)


def read_gguf_lora(path: str, cfg: DecoderConfig, weights: Weights, name: str | None = None,
                   alpha: float = 1.0) -> LoraAdapter:
    """A llama.cpp GGUF LoRA (general.type "adapter", adapter.type "lora") for this base: its scale, as
    llama.cpp's, is alpha * adapter.lora.alpha / rank (alpha alone where the file's is 0)."""
    name = adapter_name(path, name)
    strength = check_scale(alpha, f"{path}: alpha")
    f = read_gguf(path)
    meta = f.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise UnsupportedModelError(f"{path}: not a GGUF LoRA (general.type {meta.get('general.type')!r}, "
                                    f"adapter.type {meta.get('adapter.type')!r})")
    arch = lookup(cfg.model_type).gguf_arch
    if meta.get("general.architecture") != arch:
        raise ModelLoadError(f"{path}: an adapter for {meta.get('general.architecture')!r}, the base is {arch!r}")
    file_alpha = check_scale(meta.get("adapter.lora.alpha", 0.0), f"{path}: adapter.lora.alpha")
    found: dict[str, dict] = {}
    for key, tensor in f.tensors.items():
        module, dot, factor = key.removesuffix("_a").removesuffix("_b").rpartition(".weight.lora")
        if not dot or factor or not key.endswith(("_a", "_b")):
            raise ModelLoadError(f"{path}: tensor {key!r} is not a LoRA factor (NAME.weight.lora_a or _b)")
        found.setdefault(module, {})[key[-1]] = dequantize(tensor) if isinstance(tensor, QTensor) else tensor
    if not found:
        raise ModelLoadError(f"{path}: no LoRA factors")
    modules = {}
    for module, parts in found.items():
        if "a" not in parts or "b" not in parts:
            raise ModelLoadError(f"{path}: module {module} lacks {module}.weight.lora_{'a' if 'a' not in parts else 'b'}")
        rank = check_rank(int(parts["a"].shape[0]), f"{path}: rank of {module}")
        scale = strength * (file_alpha / rank if file_alpha else 1.0)
        modules[module] = factors(cfg, weights, module, parts["a"], parts["b"], scale, rank, None, path, hf_rows=False)
    return LoraAdapter(name, path, modules, strength)


def read_peft(path: str, cfg: DecoderConfig, weights: Weights, name: str | None = None,
              alpha: float = 1.0) -> LoraAdapter:
    """The adapter in directory `path` for this base, named `name` (default: the directory's name), its update
    times `alpha` (1: as trained)."""
    name = adapter_name(path, name)
    strength = check_scale(alpha, f"{path}: alpha")
    config_path, tensors_path = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
    if not os.path.isfile(config_path) or not os.path.isfile(tensors_path):
        raise ModelLoadError(f"{path}: not a PEFT adapter directory ({CONFIG} and {WEIGHTS} expected)")
    config = read_json(config_path)
    if config.get("peft_type", "LORA") != "LORA":
        raise UnsupportedModelError(f"{config_path}: peft_type {config.get('peft_type')!r}; only LORA adapters load")
    for key in UNSUPPORTED:
        if config.get(key):
            raise UnsupportedModelError(f"{config_path}: {key}={config[key]!r} is not supported at run time")
    if config.get("bias", "none") != "none":
        raise UnsupportedModelError(f"{config_path}: bias={config['bias']!r} is not supported at run time (only 'none')")
    rank = check_rank(config.get("r"), f"{config_path}: r")
    alpha = check_scale(config.get("lora_alpha", rank), f"{config_path}: lora_alpha")
    check_targets(config.get("target_modules"), cfg, weights, config_path)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise ModelLoadError(f"{config_path}: rank_pattern and alpha_pattern must be objects")
    rslora, dora = bool(config.get("use_rslora")), bool(config.get("use_dora"))
    spec = lookup(cfg.model_type)
    found: dict[str, dict] = {}
    for key, tensor in read_safetensors(tensors_path).items():
        m = TENSOR.fullmatch(key)
        if m is None:
            raise ModelLoadError(f"{tensors_path}: tensor {key!r} is not a LoRA factor of a module")
        found.setdefault(m["module"], {})[m["factor"] or "magnitude"] = tensor
    if not found:
        raise ModelLoadError(f"{tensors_path}: no LoRA factors")
    modules = {}
    for hf, parts in found.items():
        canonical = canonical_hf_name(f"{hf}.weight", spec)
        module = canonical[: -len(".weight")] if canonical else hf
        where = f"{tensors_path}: module {hf}"
        if "A" not in parts or "B" not in parts:
            raise ModelLoadError(f"{where} lacks lora_{'A' if 'A' not in parts else 'B'}")
        if ("magnitude" in parts) != dora:
            raise ModelLoadError(f"{where}: use_dora is {dora} but its magnitude is {'present' if not dora else 'missing'}")
        r = check_rank(pattern_value(rank_pattern, hf, rank), f"{config_path}: rank of {hf}")
        a_alpha = check_scale(pattern_value(alpha_pattern, hf, alpha), f"{config_path}: lora_alpha of {hf}")
        scale = strength * a_alpha / (math.sqrt(r) if rslora else r)
        modules[module] = factors(cfg, weights, module, parts["A"], parts["B"], scale, r, parts.get("magnitude"), tensors_path)
    return LoraAdapter(name, path, modules, strength)

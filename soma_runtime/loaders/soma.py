"""soma model directories (SPEC "soma model standard") and `soma-runtime import` that writes one.

    model/
      config.toml      model_type, architecture, dimensions (HF config names), [weights] files
      tokenizer.json   kept for the tokenizers library
      vocab.toml       tokenizer type and size
      chat.toml        chat template and special tokens
      sampling.toml    default inference parameters
      weights.safetensors (or the shards named in config.toml)
"""
from __future__ import annotations

import json
import os
import re
import shutil

import tomllib

from soma_runtime.architectures.fields import table
from soma_runtime.architectures.registry import canonical_hf_weights, config_for_hf
from soma_runtime.architectures.weights import Weights
from soma_runtime.errors import ModelLoadError
from soma_runtime.loaders.checkpoint import plain_file_name
from soma_runtime.loaders.hf import sampling_defaults
from soma_runtime.loaders.integrity import file_sha256, verify_pinned
from soma_runtime.loaders.model import LoadedModel
from soma_runtime.loaders.safetensors import read_safetensors
from soma_runtime.text.tokenizer import Tokenizer, read_json, token_text

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
SAMPLING_NAMES = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "max_tokens", "stop")


def read_toml(path: str, required: bool = False) -> dict:
    if not os.path.isfile(path):
        if required:
            raise ModelLoadError(f"{path}: missing")
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{path}: invalid TOML ({type(e).__name__}: {e})") from None


def weights_table(directory: str) -> tuple[dict, dict, str]:
    """config.toml's fields, its [weights] table (files, sha256 pins) and the file's path."""
    source = os.path.join(directory, "config.toml")
    config = read_toml(source, required=True)
    return config, table(config, "weights", source), source


def soma_weight_files(directory: str) -> list[str]:
    """The weight files of a soma directory: those config.toml's [weights] lists, else weights.*."""
    _, weights, source = weights_table(directory)
    files = weights.get("files") or sorted(n for n in os.listdir(directory) if n.startswith("weights."))
    if not isinstance(files, list) or not all(map(plain_file_name, files)):
        raise ModelLoadError(f"{source}: [weights] files must list file names in the directory")
    if not files:
        raise ModelLoadError(f"{directory}: no weights (config.toml [weights] files, or weights.* files)")
    return files


def load_soma_dir(directory: str):
    config, weights, source = weights_table(directory)
    files = soma_weight_files(directory)
    if "sha256" in weights:
        pins = weights["sha256"]
        unpinned = sorted(set(files) - set(pins)) if isinstance(pins, dict) else []
        if unpinned:
            raise ModelLoadError(f"{source}: [weights] sha256 pins some weight files but not {', '.join(unpinned)}")
        verify_pinned(directory, pins, source)
    config.pop("weights", None)
    spec, cfg = config_for_hf(config, source)
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(directory, name)))
    hf = Tokenizer.from_hf_dir(directory).hf
    chat = read_toml(os.path.join(directory, "chat.toml"))
    for key in ("bos_token", "eos_token", "template"):
        if not isinstance(chat.get(key, ""), str):
            raise ModelLoadError(f"{os.path.join(directory, 'chat.toml')}: {key} must be text")
    tokenizer = Tokenizer(hf, chat.get("bos_token"), chat.get("eos_token"), chat.get("add_bos_token", False),
                          chat.get("template"))
    sampling = {k: v for k, v in read_toml(os.path.join(directory, "sampling.toml")).items() if k in SAMPLING_NAMES}
    return LoadedModel(directory, "soma", cfg, Weights(canonical_hf_weights(tensors, spec), directory), tokenizer,
                       sampling, metadata=config)


# --- import -----------------------------------------------------------------------------------

def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)     # JSON string escapes are valid TOML basic strings
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def toml_key(key: str) -> str:
    """A bare key where TOML allows one, else a quoted one (`"weights.safetensors"` is one key, not two)."""
    return key if BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def dump_toml(data: dict, prefix: str = "") -> str:
    """Scalars and arrays first, then nested tables; nulls are left out (TOML has none)."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in data.items() if v is not None and not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            name = f"{prefix}.{toml_key(k)}" if prefix else toml_key(k)
            lines += ["", f"[{name}]", dump_toml(v, name)]
    return "\n".join(lines).strip() + "\n"


def import_hf_dir(src: str, dst: str) -> str:
    """Write a soma directory for a HF model directory (weights copied, or hard-linked when possible)."""
    config = read_json(os.path.join(src, "config.json"))
    if not config:
        raise ModelLoadError(f"{src}: no config.json")
    config_for_hf(config)                                      # fail early on an unsupported model
    os.makedirs(dst, exist_ok=True)
    shards = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not shards:
        raise ModelLoadError(f"{src}: no .safetensors weights")
    names = ["weights.safetensors"] if len(shards) == 1 else [f"weights-{i:05d}.safetensors" for i in range(len(shards))]
    for shard, name in zip(shards, names):
        target = os.path.join(dst, name)
        if os.path.exists(target):
            os.remove(target)
        try:
            os.link(os.path.join(src, shard), target)
        except OSError:
            shutil.copyfile(os.path.join(src, shard), target)
    skipped = ("transformers_version", "dtype", "torch_dtype")
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in skipped}
    config["weights"] = {"files": names, "sha256": {name: file_sha256(os.path.join(dst, name)) for name in names}}
    with open(os.path.join(dst, "config.toml"), "w") as f:
        f.write(dump_toml(config))
    shutil.copyfile(os.path.join(src, "tokenizer.json"), os.path.join(dst, "tokenizer.json"))
    tokenizer = Tokenizer.from_hf_dir(src)
    with open(os.path.join(dst, "vocab.toml"), "w") as f:
        kind = (read_json(os.path.join(src, "tokenizer.json")).get("model") or {}).get("type", "bpe").lower()
        f.write(dump_toml({"type": kind, "vocab_size": tokenizer.vocab_size}))
    tok_config = read_json(os.path.join(src, "tokenizer_config.json"))
    chat = {"template": tokenizer.chat_template, "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "pad_token": token_text(tok_config.get("pad_token")), "add_bos_token": tokenizer.add_bos}
    with open(os.path.join(dst, "chat.toml"), "w") as f:
        f.write(dump_toml(chat))
    sampling = sampling_defaults(read_json(os.path.join(src, "generation_config.json")))
    with open(os.path.join(dst, "sampling.toml"), "w") as f:
        f.write(dump_toml(sampling) if sampling else "# the model sets no sampling defaults\n")
    return dst

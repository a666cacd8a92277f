"""CTranslate2 model directories: model.bin (the converted spec's variables), config.json, and the
vocabulary (tokenizer.json, or vocabulary.txt/json). Whisper specs are read; their variables are renamed
to the HF names the whisper template builds from.

model.bin: u32 binary version (5 or 6 here), the spec's name and revision, u32 variable count, then each
variable: name (u16 length, NUL-terminated bytes), u8 rank, u32 dims, u8 dtype (f32 i8 i16 i32 f16 bf16),
u32 byte count, the data; then u32 alias count and (alias, target) name pairs. int8/int16 weights carry a
per-row `weight_scale` (w = q / scale). Nothing is trusted: every size is checked against the file.
"""
from __future__ import annotations

import mmap
import os
import re
import struct

import numpy as np

from soma_runtime.architectures.weights import Weights
from soma_runtime.architectures.whisper import WhisperConfig
from soma_runtime.errors import ModelLoadError, UnsupportedModelError
from soma_runtime.loaders.model import LoadedModel
from soma_runtime.text.tokenizer import Tokenizer, read_json

BINARY_VERSIONS = (5, 6)
CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: None}   # 5: bfloat16
MAX_RANK = 8


def is_ctranslate2_dir(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "model.bin"))


class Reader:
    """Little-endian fields from an mmapped file, each bounded by its end."""

    def __init__(self, data, path: str):
        self.data, self.path, self.at = data, path, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.data):
            raise ModelLoadError(f"{self.path}: truncated at byte {self.at} (needs {n} more, the file has {len(self.data)})")
        view = memoryview(self.data)[self.at: self.at + n]
        self.at += n
        return view

    def unpack(self, fmt: str):
        values = struct.unpack(fmt, self.take(struct.calcsize(fmt)))
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        n = self.unpack("<H")
        raw = bytes(self.take(n))
        if n == 0 or raw[-1] != 0:
            raise ModelLoadError(f"{self.path}: a malformed name at byte {self.at - n}")
        try:
            return raw[:-1].decode()
        except UnicodeDecodeError:
            raise ModelLoadError(f"{self.path}: a name that is not UTF-8 at byte {self.at - n}") from None


def read_model_bin(path: str) -> tuple[str, dict[str, np.ndarray]]:
    """(spec name, {variable name: array}) with aliases resolved; arrays are views into the mapped file."""
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.path.getsize(path) else b""
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from None
    r = Reader(data, path)
    version = r.unpack("<I")
    if version not in BINARY_VERSIONS:
        raise UnsupportedModelError(f"{path}: CTranslate2 binary version {version}; versions {BINARY_VERSIONS} are read")
    spec, _revision = r.string(), r.unpack("<I")
    variables = {}
    for _ in range(r.unpack("<I")):
        name, rank = r.string(), r.unpack("<B")
        if rank > MAX_RANK:
            raise ModelLoadError(f"{path}: variable {name!r} has rank {rank}")
        dims = r.unpack(f"<{rank}I") if rank else ()
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        code, size = r.unpack("<BI")
        if code not in CT2_DTYPES or CT2_DTYPES[code] is None:
            raise UnsupportedModelError(f"{path}: variable {name!r} has data type {code}, not one read here")
        dtype = np.dtype(CT2_DTYPES[code])
        if size != int(np.prod(dims, dtype=np.int64)) * dtype.itemsize:
            raise ModelLoadError(f"{path}: variable {name!r} of shape {list(dims)} says it holds {size} bytes")
        variables[name] = np.frombuffer(r.take(size), dtype).reshape(dims)
    if r.at < len(data):
        for _ in range(r.unpack("<I")):
            alias, target = r.string(), r.string()
            if target not in variables:
                raise ModelLoadError(f"{path}: alias {alias!r} names a missing variable {target!r}")
            variables[alias] = variables[target]
    return spec, variables


def dequantized(variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float weights: int8/int16 weights divided by their per-row scales, the scales dropped."""
    out = {}
    for name, value in variables.items():
        if name.endswith("_scale"):
            continue
        scale = variables.get(f"{name}_scale")
        if value.dtype in (np.int8, np.int16) and scale is not None:
            scale = np.asarray(scale, np.float32)
            value = value.astype(np.float32) / (scale.reshape(-1, *[1] * (value.ndim - 1)) if scale.ndim else scale)
        out[name] = value
    return out


LAYER = re.compile(r"(encoder|decoder)/layer_(\d+)/(self_attention|attention|ffn)/(\w+)/(\w+)$")
NORM = {"gamma": "weight", "beta": "bias"}
BLOCK_NORMS = {"self_attention": "self_attn_layer_norm", "attention": "encoder_attn_layer_norm", "ffn": "final_layer_norm"}
PLAIN = {"encoder/conv1": "model.encoder.conv1", "encoder/conv2": "model.encoder.conv2",
         "encoder/position_encodings/encodings": "model.encoder.embed_positions.weight",
         "decoder/position_encodings/encodings": "model.decoder.embed_positions.weight",
         "decoder/embeddings/weight": "model.decoder.embed_tokens.weight"}


def whisper_hf_names(variables: dict[str, np.ndarray], path: str) -> dict[str, np.ndarray]:
    """CTranslate2's whisper variables under the names of transformers' WhisperForConditionalGeneration:
    fused q/k/v (and cross k/v) projections split, layer norms renamed."""
    out = {}
    for name, value in variables.items():
        value = np.asarray(value, np.float32) if value.dtype.kind == "f" else value
        if m := LAYER.match(name):
            half, i, block, part, field = m.groups()
            p = f"model.{half}.layers.{i}"
            if part == "layer_norm":
                out[f"{p}.{BLOCK_NORMS[block]}.{NORM[field]}"] = value
                continue
            attn = "self_attn" if block == "self_attention" else "encoder_attn"
            if block == "ffn":
                out[f"{p}.fc{int(part[-1]) + 1}.{field}"] = value
            elif part == "linear_0" and block == "self_attention":
                for proj, chunk in zip(("q", "k", "v"), np.split(value, 3, axis=0)):
                    if not (proj == "k" and field == "bias"):
                        out[f"{p}.{attn}.{proj}_proj.{field}"] = chunk
            elif part == "linear_0":
                out[f"{p}.{attn}.q_proj.{field}"] = value
            elif part == "linear_1" and block == "attention":
                for proj, chunk in zip(("k", "v"), np.split(value, 2, axis=0)):
                    if not (proj == "k" and field == "bias"):
                        out[f"{p}.{attn}.{proj}_proj.{field}"] = chunk
            else:
                out[f"{p}.{attn}.out_proj.{field}"] = value
        elif re.fullmatch(r"(encoder|decoder)/layer_norm/(gamma|beta)", name):
            half, _, field = name.split("/")
            out[f"model.{half}.layer_norm.{NORM[field]}"] = value
        elif name.rsplit("/", 1)[0] in PLAIN and name.rsplit("/", 1)[1] in ("weight", "bias"):
            out[f"{PLAIN[name.rsplit('/', 1)[0]]}.{name.rsplit('/', 1)[1]}"] = value
        elif name in PLAIN:
            out[PLAIN[name]] = value
    missing = [n for n in ("model.encoder.conv1.weight", "model.decoder.embed_tokens.weight") if n not in out]
    if missing:
        raise ModelLoadError(f"{path}: not a whisper model (no {', '.join(missing)})")
    return out


def whisper_config(variables: dict[str, np.ndarray], tensors: dict[str, np.ndarray], path: str) -> WhisperConfig:
    """The template's config from the variables' shapes and the stored head counts."""
    def layers(half):
        return len({k.split(".")[3] for k in tensors if k.startswith(f"model.{half}.layers.")})

    def heads(half):
        value = variables.get(f"{half}/num_heads")
        if value is None or value.size != 1:
            raise ModelLoadError(f"{path}: {half}/num_heads is missing")
        return int(value.reshape(()))

    embed = tensors["model.decoder.embed_tokens.weight"]
    return WhisperConfig.from_hf({
        "vocab_size": embed.shape[0], "d_model": embed.shape[1], "encoder_layers": layers("encoder"),
        "encoder_attention_heads": heads("encoder"), "encoder_ffn_dim": tensors["model.encoder.layers.0.fc1.weight"].shape[0],
        "decoder_layers": layers("decoder"), "decoder_attention_heads": heads("decoder"),
        "decoder_ffn_dim": tensors["model.decoder.layers.0.fc1.weight"].shape[0],
        "num_mel_bins": tensors["model.encoder.conv1.weight"].shape[1],
        "max_source_positions": tensors["model.encoder.embed_positions.weight"].shape[0],
        "max_target_positions": tensors["model.decoder.embed_positions.weight"].shape[0]}, path)


def ctranslate2_tokenizer(directory: str) -> Tokenizer:
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise ModelLoadError(f"{directory}: a CTranslate2 whisper directory needs tokenizer.json")
    return Tokenizer.from_hf_dir(directory)


def load_ctranslate2_dir(directory: str) -> LoadedModel:
    path = os.path.join(directory, "model.bin")
    spec, variables = read_model_bin(path)
    if spec != "WhisperSpec":
        raise UnsupportedModelError(f"{path}: CTranslate2 spec {spec!r}; only whisper (WhisperSpec) is read")
    tensors = whisper_hf_names(dequantized(variables), path)
    cfg = whisper_config(variables, tensors, path)
    metadata = read_json(os.path.join(directory, "config.json"))
    return LoadedModel(directory, "ctranslate2", cfg, Weights(tensors, directory), ctranslate2_tokenizer(directory),
                       metadata=metadata)

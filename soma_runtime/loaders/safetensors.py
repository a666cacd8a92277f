"""safetensors files, mmapped: each tensor is a numpy view into the file, nothing is copied.

Format: u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, data.
Sharded checkpoints list their files in `model.safetensors.index.json`.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from soma_runtime.dtypes import DTYPES
from soma_runtime.errors import ModelLoadError

SAFETENSORS_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F64": "f64", "I64": "i64", "I32": "i32",
                      "I16": "i16", "I8": "i8", "U8": "u8", "BOOL": "bool"}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ModelLoadError(f"{path}: truncated (header of {header_len} bytes, file of {size})")
            header = json.loads(f.read(header_len))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len) if size > 8 + header_len else np.zeros(0, np.uint8)
    tensors = {}
    for name, info in header.items():
        kind = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if kind is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')}")
        start, end = info["data_offsets"]
        np_dtype = DTYPES[kind].numpy
        shape = tuple(info["shape"])
        if end > data.size or end - start != int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize:
            raise ModelLoadError(f"{path}: tensor {name!r} of shape {list(shape)} does not fit bytes {start}..{end} "
                                 f"of a {data.size}-byte data section")
        tensors[name] = data[start:end].view(np_dtype).reshape(shape)
    return tensors


def read_checkpoint(directory: str) -> dict[str, np.ndarray]:
    """All tensors of a HF directory: model.safetensors, or the shards its index names."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no .safetensors weights found")
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(directory, name)))
    return tensors

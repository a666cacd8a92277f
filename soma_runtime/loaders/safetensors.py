"""safetensors files, mmapped: each tensor is a numpy view into the file, nothing is copied.

Format: u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, data.
A Hugging Face directory's files (sharded or not) are found by checkpoint.py.
"""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

from soma_runtime.dtypes import DTYPES
from soma_runtime.errors import ModelLoadError
from soma_runtime.loaders.integrity import check_disjoint

MAX_HEADER_BYTES = 100_000_000        # the safetensors library's own limit
SAFETENSORS_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F64": "f64", "I64": "i64", "I32": "i32",
                      "I16": "i16", "I8": "i8", "U8": "u8", "BOOL": "bool"}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one file as a view into its mmapped data; the header is checked whole first
    (sizes against the file, tensors inside the data section and not overlapping)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise ModelLoadError(f"{path}: a header of {header_len} bytes does not fit a file of {size} bytes "
                                     f"(headers are at most {MAX_HEADER_BYTES})")
            header = json.loads(f.read(header_len))
    except (OSError, struct.error, ValueError, RecursionError) as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len) if data_size else np.zeros(0, np.uint8)
    tensors, spans = {}, []
    for name, info in header.items():
        kind, shape, (start, end) = tensor_entry(path, name, info, data_size)
        spans.append((start, end, name))
        tensors[name] = data[start:end].view(DTYPES[kind].numpy).reshape(shape)
    check_disjoint(spans, path)
    return tensors


def tensor_entry(path: str, name: str, info, data_size: int) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, byte range) of one header entry, each checked against the format and the data."""
    if not isinstance(info, dict):
        raise ModelLoadError(f"{path}: tensor {name!r}: expected {{dtype, shape, data_offsets}}, got {type(info).__name__}")
    kind = SAFETENSORS_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if kind is None:
        raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ModelLoadError(f"{path}: tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets):
        raise ModelLoadError(f"{path}: tensor {name!r}: data_offsets must be [start, end], got {offsets!r}")
    start, end = offsets
    nbytes = math.prod(shape) * DTYPES[kind].numpy.itemsize
    if not 0 <= start <= end <= data_size or end - start != nbytes:
        raise ModelLoadError(f"{path}: tensor {name!r} of shape {shape} ({nbytes} bytes) does not fit bytes {start}..{end} "
                             f"of a {data_size}-byte data section")
    return kind, tuple(shape), (start, end)

"""GGUF files: metadata and tensors, mmapped and used in place (QTensor / numpy views).

Returns raw pieces (metadata dict, tensors by GGUF name); turning them into a model config is the
architecture registry's job. Every way a file can be wrong ends in ModelLoadError naming the file.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from soma_runtime.dtypes import BY_GGML_ID, QTensor
from soma_runtime.errors import ModelLoadError
from soma_runtime.loaders.integrity import check_disjoint
from soma_runtime.loaders.model import LoadedModel

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFFile:
    path: str
    metadata: dict
    tensors: dict      # GGUF name -> np.ndarray (plain types) or QTensor (block formats), in place


# GGUF value types -> struct format (fixed-size scalars); 8 = string, 9 = array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


MAX_DIMS = 4               # GGML_MAX_DIMS
MAX_NESTING = 8            # arrays of arrays; real files nest one level at most
MIN_KV_BYTES = 8 + 4 + 1   # a key's length, its value's type, a value of one byte
MIN_TENSOR_BYTES = 8 + 4 + 4 + 8   # name length, dim count, type, offset


class _Cursor:
    """Reads GGUF's little-endian header fields out of the mmapped bytes; every count is checked
    against the bytes left before anything is allocated for it."""

    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str):
        raise ModelLoadError(f"{self.path}: {what} (at byte {self.pos})")

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if size > self.left():
            self.fail("truncated in the header")
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.take("Q")
        if n > self.left():
            self.fail(f"truncated in the header (a string of {n} bytes)")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int, depth: int = 0):
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            self.fail(f"unknown metadata value type {kind}")
        if depth >= MAX_NESTING:
            self.fail(f"arrays nested more than {MAX_NESTING} deep")
        inner, count = self.take("I"), self.take("Q")
        least = struct.calcsize(SCALARS[inner]) if inner in SCALARS else 8 if inner in (STRING, ARRAY) else 1
        if count * least > self.left():
            self.fail(f"truncated in the header (an array of {count} values)")
        if inner in SCALARS:
            values = np.frombuffer(self.buf, np.dtype("<" + SCALARS[inner]), count, self.pos).tolist()
            self.pos += count * least
            return values
        return [self.value(inner, depth + 1) for _ in range(count)]


def read_gguf(path: str) -> GGUFFile:
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file")
    size = os.path.getsize(path)
    if size < 24:
        raise ModelLoadError(f"{path}: truncated ({size} bytes)")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic)")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("IQQ")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2, 3)")
    if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_BYTES > cur.left():
        raise ModelLoadError(f"{path}: truncated in the header: {n_kv} metadata entries and {n_tensors} tensors "
                             f"cannot fit {size} bytes")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))
    infos = [tensor_info(cur) for _ in range(n_tensors)]
    align = metadata.get("general.alignment", 32)
    if type(align) is not int or align < 1 or align & (align - 1):
        raise ModelLoadError(f"{path}: general.alignment must be a power of two, got {align!r}")
    data_start = -(-cur.pos // align) * align
    tensors, spans = {}, []
    for name, shape, type_id, offset in infos:
        kind = BY_GGML_ID.get(type_id)
        if kind is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported GGML type {type_id}")
        if name in tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} appears twice")
        if shape[-1] % kind.block_size:
            raise ModelLoadError(f"{path}: tensor {name!r} has rows of {shape[-1]}, "
                                 f"not whole {kind.name} blocks of {kind.block_size}")
        if offset % align:
            raise ModelLoadError(f"{path}: tensor {name!r} at offset {offset} is not aligned to {align}")
        nbytes = math.prod(shape[:-1]) * kind.row_bytes(shape[-1])
        start = data_start + offset
        if start + nbytes > size:
            raise ModelLoadError(f"{path}: truncated: tensor {name!r} ends at byte {start + nbytes}, file has {size}")
        spans.append((start, start + nbytes, name))
        raw = buf[start:start + nbytes]
        tensors[name] = QTensor(raw, kind, shape) if kind.quantized else raw.view(kind.numpy).reshape(shape)
    check_disjoint(spans, path)
    return GGUFFile(path, metadata, tensors)


def tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """(name, shape outermost first, GGML type, offset) of one tensor, its dims checked."""
    name = cur.string()
    n_dims = cur.take("I")
    if not 1 <= n_dims <= MAX_DIMS:
        cur.fail(f"tensor {name!r} has {n_dims} dims (1 to {MAX_DIMS})")
    dims = [cur.take("Q") for _ in range(n_dims)]
    if not all(1 <= d < 2**62 for d in dims):
        cur.fail(f"tensor {name!r} has dims {dims}: each must be at least 1")
    return name, tuple(reversed(dims)), cur.take("I"), cur.take("Q")     # dims listed innermost first


def load_gguf_model(path: str):
    from soma_runtime.architectures.moe import merge_split_experts
    from soma_runtime.architectures.registry import config_for_gguf
    from soma_runtime.architectures.weights import Weights
    from soma_runtime.text.tokenizer import Tokenizer
    f = read_gguf(path)
    tensors = merge_split_experts(f.tensors, path)
    _, cfg = config_for_gguf(f.metadata, set(tensors), path)
    tokenizer = Tokenizer.from_gguf(f.metadata, path)
    # the vocabulary's long arrays live on in the tokenizer; as Python lists they would hold ~15 MB
    metadata = {k: v for k, v in f.metadata.items() if not (isinstance(v, list) and len(v) > 1024)}
    return LoadedModel(path, "gguf", cfg, Weights(tensors, path), tokenizer, metadata=metadata)

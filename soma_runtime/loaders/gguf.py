"""GGUF files: metadata and tensors, mmapped and used in place (QTensor / numpy views).

Returns raw pieces (metadata dict, tensors by GGUF name); turning them into a model config is the
architecture registry's job. Every way a file can be wrong ends in ModelLoadError naming the file.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from soma_runtime.dtypes import BY_GGML_ID, QTensor
from soma_runtime.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFFile:
    path: str
    metadata: dict
    tensors: dict      # GGUF name -> np.ndarray (plain types) or QTensor (block formats), in place


# GGUF value types -> struct format (fixed-size scalars); 8 = string, 9 = array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


class _Cursor:
    """Reads GGUF's little-endian header fields out of the mmapped bytes."""

    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated in the header (at byte {self.pos})")
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated in the header (a string of {n} bytes at byte {self.pos})")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            inner, count = self.take("I"), self.take("Q")
            if inner in SCALARS:
                size = struct.calcsize(SCALARS[inner]) * count
                if self.pos + size > len(self.buf):
                    raise ModelLoadError(f"{self.path}: truncated in the header (an array at byte {self.pos})")
                values = np.frombuffer(self.buf, np.dtype("<" + SCALARS[inner]), count, self.pos).tolist()
                self.pos += size
                return values
            return [self.value(inner) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: unknown metadata value type {kind} at byte {self.pos}")


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
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        infos.append((name, tuple(reversed(dims)), cur.take("I"), cur.take("Q")))   # dims listed innermost first
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    tensors = {}
    for name, shape, type_id, offset in infos:
        kind = BY_GGML_ID.get(type_id)
        if kind is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported GGML type {type_id}")
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * kind.row_bytes(shape[-1]) if shape else kind.type_size
        start = data_start + offset
        if start + nbytes > size:
            raise ModelLoadError(f"{path}: truncated: tensor {name!r} ends at byte {start + nbytes}, file has {size}")
        raw = buf[start:start + nbytes]
        if kind.quantized:
            tensors[name] = QTensor(raw, kind, shape)
        else:
            tensors[name] = raw.view(kind.numpy).reshape(shape)
    return GGUFFile(path, metadata, tensors)


def load_gguf_model(path: str):
    from soma_runtime.architectures.decoder import Weights
    from soma_runtime.architectures.registry import config_for_gguf
    from soma_runtime.loaders import LoadedModel
    from soma_runtime.text.tokenizer import Tokenizer
    f = read_gguf(path)
    _, cfg = config_for_gguf(f.metadata, set(f.tensors))
    tokenizer = Tokenizer.from_gguf(f.metadata, path)
    if not cfg.vocab_size:
        cfg.vocab_size = tokenizer.vocab_size
    # the vocabulary's long arrays live on in the tokenizer; as Python lists they would hold ~15 MB
    metadata = {k: v for k, v in f.metadata.items() if not (isinstance(v, list) and len(v) > 1024)}
    return LoadedModel(path, "gguf", cfg, Weights(f.tensors, path), tokenizer, metadata=metadata)

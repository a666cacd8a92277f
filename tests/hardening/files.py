"""Model files written byte by byte for the tests that corrupt them: a GGUF writer that can say
anything (dims of 0, counts that lie, arrays nested 200,000 deep), and safetensors files with any
header. The formats are written as their specs lay them out, independently of the loaders."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
U32, I32, F32, BOOL, STRING, ARRAY, U64 = 4, 5, 6, 7, 8, 9, 10


def value_bytes(kind: int, value) -> bytes:
    if kind in SCALAR:
        return struct.pack("<" + SCALAR[kind], value)
    if kind == STRING:
        raw = value.encode() if isinstance(value, str) else value
        return struct.pack("<Q", len(raw)) + raw
    inner, items = value                                  # an ARRAY: (element type, elements)
    return struct.pack("<IQ", inner, len(items)) + b"".join(value_bytes(inner, v) for v in items)


def kind_of(value) -> tuple[int, object]:
    """The GGUF type a parsed metadata value is written back as."""
    if isinstance(value, bool):
        return BOOL, value
    if isinstance(value, int):
        return (U32 if 0 <= value < 2**32 else I32 if -2**31 <= value < 0 else U64), value
    if isinstance(value, float):
        return F32, value
    if isinstance(value, str):
        return STRING, value
    inner = kind_of(value[0])[0] if value else U32
    return ARRAY, (inner, value)


@dataclass
class Gguf:
    """A GGUF's parts, each free to be made wrong. Tensors: name -> (GGML type, dims innermost first, bytes)."""
    kv: dict[str, tuple[int, object]] = field(default_factory=dict)
    tensors: dict[str, tuple[int, list[int], bytes]] = field(default_factory=dict)
    alignment: int = 32
    raw_kv: list[bytes] = field(default_factory=list)     # extra entries, already encoded

    @classmethod
    def read(cls, path: str) -> Gguf:
        from soma_runtime.dtypes import QTensor
        from soma_runtime.loaders.gguf import read_gguf
        f = read_gguf(path)
        kv = {k: kind_of(v) for k, v in f.metadata.items() if k != "general.alignment"}
        tensors = {}
        for name, t in f.tensors.items():
            raw = np.asarray(t.data if isinstance(t, QTensor) else t)
            kind = t.dtype.ggml_id if isinstance(t, QTensor) else {"float32": 0, "float16": 1}[raw.dtype.name]
            tensors[name] = (kind, list(reversed(t.shape)), raw.tobytes())
        return cls(kv, tensors)

    def to_bytes(self, n_kv: int | None = None, n_tensors: int | None = None, version: int = 3,
                 offsets: dict[str, int] | None = None) -> bytes:
        kv = dict(self.kv)
        if self.alignment != 32:
            kv["general.alignment"] = (U32, self.alignment)
        entries = [value_bytes(STRING, k) + struct.pack("<I", t) + value_bytes(t, v) for k, (t, v) in kv.items()]
        entries += self.raw_kv
        align = self.alignment if self.alignment > 0 else 32
        data, infos, at = b"", [], 0
        for name, (kind, dims, raw) in self.tensors.items():
            at = -(-at // align) * align
            data = data.ljust(at, b"\0") + raw
            offset = (offsets or {}).get(name, at)
            infos.append(value_bytes(STRING, name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                         + struct.pack("<IQ", kind, offset))
            at += len(raw)
        head = b"GGUF" + struct.pack("<IQQ", version, len(self.tensors) if n_tensors is None else n_tensors,
                                     len(entries) if n_kv is None else n_kv)
        head += b"".join(entries) + b"".join(infos)
        return head.ljust(-(-len(head) // align) * align, b"\0") + data

    def save(self, path, **kwargs) -> str:
        with open(path, "wb") as f:
            f.write(self.to_bytes(**kwargs))
        return str(path)


def nested_arrays(depth: int) -> bytes:
    """An ARRAY value holding one ARRAY holding one ... `depth` deep, ending in a u32."""
    return struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQI", U32, 1, 7)


def safetensors_bytes(header, data: bytes = b"", header_len: int | None = None) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data

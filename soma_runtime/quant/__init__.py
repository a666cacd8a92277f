"""Quantized tensors to and from f32: the GGUF block formats dtypes.py documents, decoded by
formats.py and encoded by encode.py byte for byte as ggml does."""
from __future__ import annotations

import numpy as np

from soma_runtime.dtypes import QTensor, dtype
from soma_runtime.quant import encode, formats


def dequantize(t: QTensor, rows: np.ndarray | None = None) -> np.ndarray:
    """f32 values of a quantized tensor (or of the selected rows only, e.g. for an embedding)."""
    data = t.data if rows is None else t.data[np.asarray(rows).reshape(-1)]
    out = formats.dequantize_rows(data, t.dtype.ggml_id, t.shape[-1])
    shape = t.shape[:-1] if rows is None else np.shape(rows)
    return out.reshape(*shape, t.shape[-1])


def quantize(x: np.ndarray, dtype_name: str) -> QTensor:
    """Encode f32 values into a GGUF block format, byte-identical to ggml's reference encoder."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    d = dtype(dtype_name)
    if d.name not in encode.ENCODERS:
        raise ValueError(f"quantize to {d.name} is not supported; supported: {', '.join(encode.ENCODERS)}")
    if x.shape[-1] % d.block_size:
        raise ValueError(f"{d.name}: last dimension {x.shape[-1]} is not a multiple of {d.block_size}")
    blocks = encode.ENCODERS[d.name](x.reshape(-1, d.block_size))
    return QTensor(blocks.reshape(-1), d, x.shape)

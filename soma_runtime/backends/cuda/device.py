"""Device memory for the CUDA backend: host arrays <-> torch tensors on the GPU, block-quantized
weights kept in their format, and the wrapper every CUDA jet goes through.

The 32-weight formats (q4_0, q4_1, q8_0) are stored *planar* on the device: each row's quants
first, then its f16 scales (then q4_1's mins), the row padded to 16 bytes. These are the GGUF
blocks' bytes regrouped: GGUF's 18-byte blocks are only 2-byte aligned, and the kernels want
16-byte loads of quants. The K-quants keep their GGUF bytes.

Without a GPU, `TRITON_INTERPRET=1` runs the same Triton kernels on the CPU (numpy underneath) on
torch CPU tensors: that is how CI runs the cross-backend op test on these jets.
"""
from __future__ import annotations

import functools
import os
import warnings

import numpy as np
import torch

from soma_runtime.dtypes import QTensor, dtype

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32, "i64": torch.int64,
         "bool": torch.bool, "u8": torch.uint8, "i8": torch.int8}


def device() -> torch.device:
    return torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")


# GGML ids of the formats stored planar -> bytes of a block's header (d, or d and m)
PLANAR_HEADER = {2: 2, 3: 4, 8: 2}


class DeviceQTensor:
    """A block-quantized weight on the device: its bytes [rows, row stride] (uint8: GGUF blocks, or
    planar rows) and logical shape."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: torch.Tensor, dtype_name, shape: tuple[int, ...]):
        self.data, self.dtype, self.shape = data, dtype(dtype_name), tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def place(value):
    """A host value on the device (weights stay in their stored format); device values pass through."""
    if isinstance(value, (torch.Tensor, DeviceQTensor)) or value is None:
        return value
    if isinstance(value, QTensor):
        data = place(value.data)
        return DeviceQTensor(planar(data, value.dtype) if value.dtype.ggml_id in PLANAR_HEADER else data, value.dtype,
                             value.shape)
    array = np.ascontiguousarray(value)
    bf16 = array.dtype.name == "bfloat16"                  # ml_dtypes' bf16: move the bits
    with warnings.catch_warnings():                        # read-only mmapped weights: copied to the device, never written
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(array.view(np.uint16) if bf16 else array)
    return (tensor.view(torch.bfloat16) if bf16 else tensor).to(device())


def fetch(value):
    """A device value back on the host: numpy (bf16 as ml_dtypes' bfloat16), or a QTensor."""
    if isinstance(value, DeviceQTensor):
        planar_rows = value.dtype.ggml_id in PLANAR_HEADER
        data = blocked(value.data, value.dtype, value.shape[-1]) if planar_rows else value.data
        return QTensor(data.cpu().numpy(), value.dtype, value.shape)
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        return value.view(torch.uint16).numpy().view(dtype("bf16").numpy)
    return value.numpy()


def fetch_soon(value):
    """Start a device value's copy to the host; the function returned waits for that copy alone (work
    queued after it runs on) and gives what `fetch` gives."""
    if value.device.type != "cuda":
        return lambda: fetch(value)
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return lambda: (copied.synchronize(), fetch(host))[1]


def planar(rows: torch.Tensor, kind) -> torch.Tensor:
    """GGUF rows of 32-weight blocks -> planar rows: quants, then scales (then mins), 16-byte padded."""
    header = PLANAR_HEADER[kind.ggml_id]
    blocks = rows.reshape(rows.shape[0], -1, kind.type_size)
    parts = [blocks[:, :, header:], blocks[:, :, 0:2]] + ([blocks[:, :, 2:4]] if header == 4 else [])
    parts.append(rows.new_zeros((rows.shape[0], -rows.shape[1] % 16)))
    return torch.cat([p.reshape(rows.shape[0], -1) for p in parts], dim=1)


def blocked(rows: torch.Tensor, kind, n: int) -> torch.Tensor:
    """`planar`'s inverse: the GGUF rows of n weights each."""
    header, count = PLANAR_HEADER[kind.ggml_id], n // 32
    quant_bytes = count * (kind.type_size - header)
    quants = rows[:, :quant_bytes].reshape(rows.shape[0], count, -1)
    fields = rows[:, quant_bytes:quant_bytes + count * header].reshape(rows.shape[0], header // 2, count, 2)
    return torch.cat([fields.transpose(1, 2).reshape(rows.shape[0], count, header), quants], dim=2).reshape(rows.shape[0], -1)


def zeros(shape: tuple[int, ...], dtype_name: str) -> torch.Tensor:
    return torch.zeros(shape, dtype=TORCH[dtype_name], device=device())


def device_jet(fn):
    """Inputs on the device before the kernel runs (the op test passes host arrays); `out` is ignored:
    the caching allocator, not a host arena, places intermediates."""
    @functools.wraps(fn)
    def run(*inputs, out=None, **attrs):
        return fn(*[place(x) for x in inputs], **attrs)
    return run

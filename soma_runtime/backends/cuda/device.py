"""Device memory for the CUDA backend: host arrays <-> torch tensors on the GPU, block-quantized
weights kept as their GGUF bytes, and the wrapper every CUDA jet goes through.

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
SOMA = {v: k for k, v in TORCH.items()}


def device() -> torch.device:
    return torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")


class DeviceQTensor:
    """A block-quantized weight on the device: its GGUF bytes [rows, row_bytes] (uint8) and logical shape."""

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
        return DeviceQTensor(place(value.data), value.dtype, value.shape)
    array = np.ascontiguousarray(value)
    bf16 = array.dtype.name == "bfloat16"                  # ml_dtypes' bf16: move the bits
    with warnings.catch_warnings():                        # read-only mmapped weights: copied to the device, never written
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(array.view(np.uint16) if bf16 else array)
    return (tensor.view(torch.bfloat16) if bf16 else tensor).to(device())


def fetch(value):
    """A device value back on the host: numpy (bf16 as ml_dtypes' bfloat16), or a QTensor."""
    if isinstance(value, DeviceQTensor):
        return QTensor(value.data.cpu().numpy(), value.dtype, value.shape)
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        return value.view(torch.uint16).numpy().view(dtype("bf16").numpy)
    return value.numpy()


def soma_dtype(x) -> str:
    return x.dtype.name if isinstance(x, DeviceQTensor) else SOMA[x.dtype]


def zeros(shape: tuple[int, ...], dtype_name: str) -> torch.Tensor:
    return torch.zeros(shape, dtype=TORCH[dtype_name], device=device())


def device_jet(fn):
    """Inputs on the device before the kernel runs (the op test passes host arrays); `out` is ignored:
    the caching allocator, not a host arena, places intermediates."""
    @functools.wraps(fn)
    def run(*inputs, out=None, **attrs):
        return fn(*[place(x) for x in inputs], **attrs)
    return run

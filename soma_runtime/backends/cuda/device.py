"""Device memory for the CUDA backend: host arrays <-> torch tensors on the GPU, block-quantized
weights kept in their format, and the wrapper every CUDA jet goes through.

The 32-weight formats (q4_0, q4_1, q8_0) and q6_K are stored *planar* on the device: each field of
the row's blocks in a plane of its own (quants first, then f16 scales, then q4_1's mins; q6_K's low
bits, high bits, scales, then d), the row padded to 16 bytes. These are the GGUF blocks' bytes
regrouped: GGUF's 18- and 210-byte blocks are only 2-byte aligned, and the kernels want 16-byte
loads of quants. q4_K's and q5_K's 144- and 176-byte blocks are aligned already and keep their GGUF
bytes.

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
from soma_runtime.quant import formats

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = "cuda"                           # the backend's name, as jets register under it
F = ("f32", "f16", "bf16")              # the dtype groups jet signatures name
INT = ("i32", "i64")
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32, "i64": torch.int64,
         "bool": torch.bool, "u8": torch.uint8, "i8": torch.int8, "i16": torch.int16, "f64": torch.float64,
         "u16": torch.uint16, "u32": torch.uint32, "u64": torch.uint64}


def device() -> torch.device:
    return torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")


# GGML ids of the formats stored planar -> the byte ranges of a block that become planes, in plane order
PLANES = {formats.Q4_0: ((2, 18), (0, 2)), formats.Q4_1: ((4, 20), (0, 2), (2, 4)), formats.Q8_0: ((2, 34), (0, 2)),
          formats.Q6_K: ((0, 128), (128, 192), (192, 208), (208, 210))}


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
        return DeviceQTensor(planar(data, value.dtype) if value.dtype.ggml_id in PLANES else data, value.dtype,
                             value.shape)
    array = np.asarray(value)
    array = array if array.flags.c_contiguous else np.ascontiguousarray(array)   # (which would make a 0-d one 1-d)
    bf16 = array.dtype.name == "bfloat16"                  # ml_dtypes' bf16: move the bits
    with warnings.catch_warnings():                        # read-only mmapped weights: copied to the device, never written
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(array.view(np.uint16) if bf16 else array)
    return (tensor.view(torch.bfloat16) if bf16 else tensor).to(device())


def fetch(value):
    """A device value back on the host: numpy (bf16 as ml_dtypes' bfloat16), or a QTensor."""
    if isinstance(value, DeviceQTensor):
        planar_rows = value.dtype.ggml_id in PLANES
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
    """GGUF rows of blocks -> planar rows: each of the format's PLANES in turn, 16-byte padded."""
    blocks = rows.reshape(rows.shape[0], -1, kind.type_size)
    parts = [blocks[:, :, start:end].reshape(rows.shape[0], -1) for start, end in PLANES[kind.ggml_id]]
    return torch.cat([*parts, rows.new_zeros((rows.shape[0], -rows.shape[1] % 16))], dim=1)


def blocked(rows: torch.Tensor, kind, n: int) -> torch.Tensor:
    """`planar`'s inverse: the GGUF rows of n weights each."""
    count, at, fields = n // kind.block_size, 0, {}
    for start, end in PLANES[kind.ggml_id]:
        fields[start] = rows[:, at:at + count * (end - start)].reshape(rows.shape[0], count, end - start)
        at += count * (end - start)
    return torch.cat([fields[start] for start in sorted(fields)], dim=2).reshape(rows.shape[0], -1)


def strided_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as rows of `width` contiguous values, however far apart the rows lie: a batch's queries, keys
    and values are views into its fused qkv product, read where they are (three copies a layer cost a
    batched decode step dearly); copied only where a row's values are not contiguous."""
    rows = x.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def free_bytes() -> int | None:
    """Device memory still to be had: what the driver has free plus what torch's caching allocator holds
    unused (None without a GPU: the interpreter's tensors are host memory)."""
    if device().type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def zeros(shape: tuple[int, ...], dtype_name: str) -> torch.Tensor:
    return torch.zeros(shape, dtype=TORCH[dtype_name], device=device())


def device_jet(fn):
    """Inputs on the device before the kernel runs (the op test passes host arrays); `out` is ignored:
    the caching allocator, not a host arena, places intermediates."""
    @functools.wraps(fn)
    def run(*inputs, out=None, **attrs):
        return fn(*[place(x) for x in inputs], **attrs)
    return run

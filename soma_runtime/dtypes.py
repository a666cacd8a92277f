"""Tensor element types: plain dtypes and GGUF block-quantized formats, documented once.

A quantized tensor is a `QTensor`: the raw GGUF bytes (byte-identical to the file, so an
mmapped GGUF tensor is used in place) plus its logical shape. Rows are the last axis; each row
is a whole number of blocks. The ids are GGML's type numbers: append-only, never renumbered.

Block layouts (little-endian; d/m/dmin are f16 unless said otherwise):
  q4_0  32 el, 18 B: d, qs[16]            x = (nibble - 8) * d; low nibbles hold el 0..15
  q4_1  32 el, 20 B: d, m, qs[16]         x = nibble * d + m
  q5_0  32 el, 22 B: d, qh u32, qs[16]    x = ((nibble | bit<<4) - 16) * d; bit j of qh is el j
  q5_1  32 el, 24 B: d, m, qh, qs[16]     x = (nibble | bit<<4) * d + m
  q8_0  32 el, 34 B: d, qs i8[32]         x = q * d
  q2_K 256 el, 84 B: scales[16] (lo 4 bits scale, hi 4 bits min), qs[64] 2-bit, d, dmin
  q3_K 256 el,110 B: hmask[32], qs[64] 2-bit, scales[12] 6-bit signed (-32), d
  q4_K 256 el,144 B: d, dmin, scales[12] (8 pairs of 6-bit scale/min), qs[128]
  q5_K 256 el,176 B: d, dmin, scales[12], qh[32], qs[128]
  q6_K 256 el,210 B: ql[128], qh[64], scales i8[16], d
  q8_K 256 el,292 B: d f32, qs i8[256], bsums i16[16]     (activations only)
  tq1_0 256 el, 54 B: qs[48] base-3 packed (5 trits/byte), qh[4] (4 trits/byte), d
  tq2_0 256 el, 66 B: qs[64] 2-bit trits, d                 x = (trit - 1) * d
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    ggml_id: int          # GGML type number; -1 for types GGUF does not store
    block_size: int       # elements per block (1 for plain types)
    type_size: int        # bytes per block
    numpy: np.dtype | None = None   # element dtype for plain types

    @property
    def quantized(self) -> bool:
        return self.numpy is None

    def row_bytes(self, n: int) -> int:
        if n % self.block_size:
            raise ValueError(f"{self.name}: row length {n} is not a multiple of the block size {self.block_size}")
        return n // self.block_size * self.type_size


def _plain(name, ggml_id, np_dtype):
    np_dtype = np.dtype(np_dtype)
    return DType(name, ggml_id, 1, np_dtype.itemsize, np_dtype)


DTYPES: dict[str, DType] = {d.name: d for d in [
    _plain("f32", 0, np.float32),
    _plain("f16", 1, np.float16),
    DType("q4_0", 2, 32, 18), DType("q4_1", 3, 32, 20),
    DType("q5_0", 6, 32, 22), DType("q5_1", 7, 32, 24),
    DType("q8_0", 8, 32, 34),
    DType("q2_K", 10, 256, 84), DType("q3_K", 11, 256, 110), DType("q4_K", 12, 256, 144),
    DType("q5_K", 13, 256, 176), DType("q6_K", 14, 256, 210), DType("q8_K", 15, 256, 292),
    _plain("i8", 24, np.int8), _plain("i16", 25, np.int16), _plain("i32", 26, np.int32),
    _plain("i64", 27, np.int64), _plain("f64", 28, np.float64),
    _plain("bf16", 30, ml_dtypes.bfloat16),
    DType("tq1_0", 34, 256, 54), DType("tq2_0", 35, 256, 66),
    _plain("bool", -1, np.bool_), _plain("u8", -1, np.uint8), _plain("u16", -1, np.uint16),
    _plain("u32", -1, np.uint32), _plain("u64", -1, np.uint64),
]}
BY_GGML_ID = {d.ggml_id: d for d in DTYPES.values() if d.ggml_id >= 0}
# byte offsets of the f16 fields (d, m, dmin) in each block of a stored format, as laid out above
F16_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q2_K": (80, 82), "q3_K": (108,),
              "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,), "tq1_0": (52,), "tq2_0": (64,)}
QUANTIZED = tuple(n for n, d in DTYPES.items() if d.quantized and n != "q8_K")
FLOATS = ("f32", "f16", "bf16")                  # what models compute in
REALS = (*FLOATS, "f64")
INTEGERS = ("i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")
NUMBERS = (*REALS, *INTEGERS)


def dtype(name: str | DType) -> DType:
    if isinstance(name, DType):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


BY_NUMPY = {d.numpy: d.name for d in DTYPES.values() if d.numpy is not None}


def dtype_of(array) -> str:
    """The soma dtype name of a numpy array or QTensor."""
    if isinstance(array, QTensor):
        return array.dtype.name
    try:
        return BY_NUMPY[array.dtype]
    except KeyError:
        raise ValueError(f"unsupported numpy dtype {array.dtype}") from None


class QTensor:
    """A block-quantized tensor: raw GGUF bytes shaped [rows..., row_bytes] and a logical shape."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: np.ndarray, dtype_name: str | DType, shape: tuple[int, ...]):
        self.dtype = dtype(dtype_name)
        self.shape = tuple(int(s) for s in shape)
        rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        want = rows * self.dtype.row_bytes(self.shape[-1])
        if data.dtype != np.uint8 or data.size != want:
            raise ValueError(f"{self.dtype.name} tensor of shape {self.shape} needs {want} bytes, got {data.nbytes}")
        self.data = data.reshape(rows, want // rows)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __repr__(self):
        return f"QTensor({self.dtype.name}, shape={self.shape})"


def lowest(np_dtype) -> float | int:
    """The smallest value of a numpy dtype (-inf for floats): the max of an empty set."""
    np_dtype = np.dtype(np_dtype)
    return np.iinfo(np_dtype).min if np_dtype.kind in "iu" else (False if np_dtype.kind == "b" else -np.inf)


def highest(np_dtype) -> float | int:
    """The largest value of a numpy dtype (inf for floats): the min of an empty set."""
    np_dtype = np.dtype(np_dtype)
    return np.iinfo(np_dtype).max if np_dtype.kind in "iu" else (True if np_dtype.kind == "b" else np.inf)


def descending(x: np.ndarray) -> np.ndarray:
    """A key whose ascending order is x's descending order, exact for every dtype (-x wraps for integers)."""
    if x.dtype.kind == "u":
        return np.iinfo(x.dtype).max - x
    if x.dtype.kind == "i":
        return ~x
    return -x


def truncated_quotient(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer a / b rounded toward zero (C's and ONNX's division; numpy's // floors), without the
    overflow of negating the smallest integer; 0 where b is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.floor_divide(a, b)
        inexact = np.remainder(a, b) != 0
    return np.where(inexact & ((a < 0) != (b < 0)), q + 1, q)

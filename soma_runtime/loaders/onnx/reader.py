"""Reading an .onnx file: the protobuf through the `onnx` package (parsed, never run), and tensors as
numpy arrays, external data mapped in place from files beside the model (names confined to its
directory, spans checked against the files' sizes before anything is read).
"""
from __future__ import annotations

import math
import os

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, numpy_helper

from soma_runtime.dtypes import DTYPES as OURS
from soma_runtime.errors import ModelLoadError, UnsupportedModelError

MAX_PROTO_BYTES = 2 << 30            # protobuf's own limit: past it, tensors live in external data files
DTYPES = {TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16", TensorProto.DOUBLE: "f64",
          TensorProto.INT8: "i8", TensorProto.INT16: "i16", TensorProto.INT32: "i32", TensorProto.INT64: "i64",
          TensorProto.UINT8: "u8", TensorProto.UINT16: "u16", TensorProto.UINT32: "u32", TensorProto.UINT64: "u64",
          TensorProto.BOOL: "bool"}
ELEM_TYPES = {name: elem for elem, name in DTYPES.items()}


def dtype_name(elem_type: int, where: str) -> str:
    """Our dtype for an ONNX element type; UnsupportedModelError naming `where` for the others."""
    if elem_type not in DTYPES:
        name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else str(elem_type)
        raise UnsupportedModelError(f"{where}: element type {name} is not supported")
    return DTYPES[elem_type]


def read_model(path: str) -> onnx.ModelProto:
    """The model's protobuf, its external data not yet read; ModelLoadError for a file that is none."""
    size = os.path.getsize(path)
    if size > MAX_PROTO_BYTES:
        raise ModelLoadError(f"{path}: {size} bytes, past protobuf's 2 GiB (large tensors belong in external data)")
    try:
        with open(path, "rb") as f:
            model = onnx.ModelProto.FromString(f.read())
    except (DecodeError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{path}: not an ONNX model ({type(e).__name__}: {str(e)[:200]})") from None
    if not model.HasField("graph") or not model.graph.node:
        raise ModelLoadError(f"{path}: the ONNX model has no graph")
    return model


def tensor_array(tensor: TensorProto, directory: str, where: str) -> np.ndarray:
    """A tensor's values: from the protobuf, or mapped from its external data file. Strings come as a numpy
    str array (the graph settles them at import: convert.py)."""
    if tensor.data_type == TensorProto.STRING and tensor.data_location != TensorProto.EXTERNAL:
        try:
            return np.array([s.decode() for s in tensor.string_data], dtype=str).reshape(tuple(tensor.dims))
        except (UnicodeDecodeError, ValueError) as e:
            raise ModelLoadError(f"{where}: string tensor {tensor.name!r} is not UTF-8 of its shape ({e})") from None
    dt = dtype_name(tensor.data_type, where)
    if any(d < 0 for d in tensor.dims):
        raise ModelLoadError(f"{where}: tensor {tensor.name!r} has negative dims {list(tensor.dims)}")
    itemsize = OURS[dt].numpy.itemsize
    count = math.prod(tensor.dims)
    if tensor.data_location != TensorProto.EXTERNAL:
        if count * itemsize > MAX_PROTO_BYTES:          # more than the protobuf it sits in can hold
            raise ModelLoadError(f"{where}: tensor {tensor.name!r} of shape {list(tensor.dims)} is larger than an "
                                 f"ONNX file holds")
        try:
            return numpy_helper.to_array(tensor)
        except (ValueError, TypeError) as e:
            raise ModelLoadError(f"{where}: tensor {tensor.name!r} does not hold its declared shape ({e})") from None
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location", "")
    target, home = os.path.realpath(os.path.join(directory, location)), os.path.realpath(directory)
    if not location or os.path.isabs(location) or os.path.commonpath([target, home]) != home:
        raise ModelLoadError(f"{where}: tensor {tensor.name!r} names external data {location!r} outside the model's directory")
    if not os.path.isfile(target):
        raise ModelLoadError(f"{where}: tensor {tensor.name!r}: its external data file {location!r} is missing")
    try:
        offset, length = int(info.get("offset", 0)), int(info.get("length", count * itemsize))
    except ValueError:
        raise ModelLoadError(f"{where}: tensor {tensor.name!r}: its external data offset {info.get('offset')!r} and "
                             f"length {info.get('length')!r} must be byte counts") from None
    if length != count * itemsize or offset < 0 or offset + length > os.path.getsize(target):
        raise ModelLoadError(f"{where}: tensor {tensor.name!r} of shape {list(tensor.dims)} needs {count * itemsize} bytes at "
                             f"{offset} of {location!r} ({os.path.getsize(target)} bytes)")
    if count == 0:                                     # nothing to map (mmap refuses a length of 0)
        return np.zeros(tuple(tensor.dims), OURS[dt].numpy)
    try:
        data = np.memmap(target, dtype=OURS[dt].numpy, mode="r", offset=offset, shape=(count,))
    except (OSError, ValueError, OverflowError) as e:     # past the address space this process may map
        raise ModelLoadError(f"{where}: tensor {tensor.name!r}: cannot map its {length} bytes of {location!r} "
                             f"({type(e).__name__}: {e})") from None
    return data.reshape(tuple(tensor.dims))

"""PyTorch checkpoints (`torch.save`'s zip files: pytorch_model.bin, .pt, .pth) read without running their code.

The pickle inside (`<archive>/data.pkl`) is read by a restricted unpickler that knows the few globals a state
dict is made of (an OrderedDict, torch's typed storages, `_rebuild_tensor_v2`, `_rebuild_parameter`) and
builds numpy arrays itself, as `torch.load(weights_only=True)` allows only those: any other global (a class, a
function such as os.system in a `__reduce__`) is refused with its name before anything is called. Each
storage (`<archive>/data/<key>`, stored uncompressed) is a view into the mmapped file, so a tensor is read
where it lies, strides and offsets as saved (views sharing one storage share its bytes). torch is not needed.
The legacy format (torch < 1.6, not a zip) is refused with a clear message. Knows files and numpy; nothing of
models.
"""
from __future__ import annotations

import collections
import math
import pickle
import struct
import zipfile

import numpy as np

from soma_runtime.dtypes import DTYPES
from soma_runtime.errors import ModelLoadError

STORAGES = {"FloatStorage": "f32", "HalfStorage": "f16", "BFloat16Storage": "bf16", "DoubleStorage": "f64",
            "LongStorage": "i64", "IntStorage": "i32", "ShortStorage": "i16", "CharStorage": "i8",
            "ByteStorage": "u8", "BoolStorage": "bool"}
MAX_PICKLE_BYTES = 1 << 30             # a state dict's pickle holds names and shapes; its data lies beside it
LOCAL_HEADER = struct.Struct("<4s5H3I2H")   # a zip member's local header: its name and extra field follow


class StorageType:
    """A typed storage class named in the pickle (torch.FloatStorage, ...): the dtype of its elements."""

    def __init__(self, name: str):
        self.name, self.dtype = name, STORAGES[name]


def rebuild_tensor(storage: np.ndarray, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2's tensor as a numpy view of its storage (element offset and strides)."""
    size, stride = tuple(size), tuple(stride)
    if not all(type(n) is int and n >= 0 for n in (offset, *size, *stride)) or len(size) != len(stride):
        raise ModelLoadError(f"a tensor of size {size}, stride {stride} and offset {offset!r} is not well formed")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if math.prod(size) else offset - 1
    if last >= storage.size:
        raise ModelLoadError(f"a tensor of size {size} and stride {stride} at offset {offset} reads past its "
                             f"storage of {storage.size} elements")
    item = storage.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], size, tuple(s * item for s in stride), writeable=False)


def rebuild_parameter(data, requires_grad=False, hooks=None, *rest):
    """torch._utils._rebuild_parameter's Parameter: its data."""
    return data


ALLOWED = {("collections", "OrderedDict"): collections.OrderedDict,
           ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor,
           ("torch._utils", "_rebuild_parameter"): rebuild_parameter,
           **{("torch", name): StorageType(name) for name in STORAGES}}


class StateDictUnpickler(pickle.Unpickler):
    """Builds a state dict from torch's pickle, refusing every global but ALLOWED's; storages come from the
    archive's data members, by key."""

    def __init__(self, file, path: str, storage):
        super().__init__(file)
        self.path, self.storage = path, storage

    def find_class(self, module: str, name: str):
        found = ALLOWED.get((module, name))
        if found is None:
            raise ModelLoadError(f"{self.path}: the checkpoint's pickle asks for {module}.{name}, which a state dict "
                                 f"does not hold; refusing to load it (nothing of it was run)")
        return found

    def persistent_load(self, saved):
        if not (isinstance(saved, tuple) and len(saved) == 5 and saved[0] == "storage"
                and isinstance(saved[1], StorageType) and isinstance(saved[2], str) and type(saved[4]) is int):
            raise ModelLoadError(f"{self.path}: a storage reference {saved!r:.80} is not torch's")
        _, kind, key, _, count = saved
        return self.storage(key, kind.dtype, count)


def read_pytorch(path: str) -> dict[str, np.ndarray]:
    """The tensors of a torch.save'd state dict, by name, each a read-only view into the mmapped file."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ModelLoadError(f"{path}: not a zip archive: PyTorch's legacy format (torch < 1.6) or not a checkpoint; "
                             "save it again with a current torch, or as safetensors") from None
    except OSError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    with archive:
        members = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in members if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise ModelLoadError(f"{path}: a torch checkpoint holds one <archive>/data.pkl, found {len(pickles)}")
        root = pickles[0][: -len("data.pkl")]
        if members[pickles[0]].file_size > MAX_PICKLE_BYTES:
            raise ModelLoadError(f"{path}: a pickle of {members[pickles[0]].file_size} bytes is past {MAX_PICKLE_BYTES}")
        data = np.memmap(path, dtype=np.uint8, mode="r")
        made: dict[str, np.ndarray] = {}

        def storage(key: str, kind: str, count: int) -> np.ndarray:
            if key not in made:
                info = members.get(f"{root}data/{key}")
                if info is None or info.compress_type != zipfile.ZIP_STORED:
                    raise ModelLoadError(f"{path}: storage {key!r} is missing or compressed")
                start = member_data(path, data, info)
                made[key] = data[start: start + info.file_size].view(DTYPES[kind].numpy)
            array = made[key]
            if array.dtype != DTYPES[kind].numpy or array.size < count:
                raise ModelLoadError(f"{path}: storage {key!r} holds {array.size} {array.dtype} values, read as "
                                     f"{count} {kind}")
            return array

        with archive.open(pickles[0]) as f:
            try:
                state = StateDictUnpickler(f, path, storage).load()
            except ModelLoadError:
                raise
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
                raise ModelLoadError(f"{path}: the checkpoint's pickle is not readable ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in state.items()):
        raise ModelLoadError(f"{path}: not a state dict of named tensors")
    return dict(state)


def member_data(path: str, data: np.ndarray, info: zipfile.ZipInfo) -> int:
    """Where a stored member's bytes start in the file: past its local header, name and extra field."""
    at = info.header_offset
    if at + LOCAL_HEADER.size > data.size:
        raise ModelLoadError(f"{path}: member {info.filename!r} starts past the file's end")
    fields = LOCAL_HEADER.unpack(bytes(data[at: at + LOCAL_HEADER.size]))
    if fields[0] != b"PK\x03\x04":
        raise ModelLoadError(f"{path}: member {info.filename!r} has no local header")
    start = at + LOCAL_HEADER.size + fields[-2] + fields[-1]
    if start + info.file_size > data.size:
        raise ModelLoadError(f"{path}: member {info.filename!r} runs past the file's end")
    return start

"""PyTorch checkpoints (loaders/pytorch.py) against torch's own `torch.load(weights_only=True)` in the same run: every
tensor the same, bit for bit (dtypes, strides, views sharing a storage, parameters, empty and 0-d tensors), read
in place; a pickle asking for anything a state dict does not hold (os.system in a __reduce__, a whole module) is
refused with its name and runs nothing; a HF directory with pytorch_model.bin loads as its safetensors twin."""
from __future__ import annotations

import io
import os
import pickle
import zipfile

import numpy as np
import pytest

from soma_runtime.errors import ModelLoadError
from soma_runtime.loaders.pytorch import read_pytorch

torch = pytest.importorskip("torch")


def state_dict() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    return {"w": torch.randn(4, 3, generator=g), "transposed": torch.randn(3, 7, generator=g).t(), "base": base,
            "rows": base[2:5], "column": base[:, 1], "half": torch.randn(5, generator=g).half(),
            "bf16": torch.randn(2, 3, generator=g).bfloat16(), "f64": torch.randn(3, generator=g).double(),
            "ids": torch.arange(-3, 9), "i32": torch.arange(4, dtype=torch.int32), "mask": torch.tensor([True, False]),
            "u8": torch.arange(250, 256, dtype=torch.uint8), "i8": torch.tensor([-128, 127], dtype=torch.int8),
            "param": torch.nn.Parameter(torch.ones(3)), "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}


def bits(t) -> np.ndarray:
    t = t.detach()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def test_every_tensor_equals_torchs_weights_only_load(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(state_dict(), path)
    want = torch.load(path, weights_only=True)
    got = read_pytorch(str(path))
    assert list(got) == list(want)
    for name, tensor in want.items():
        ours = got[name].view(np.int16) if tensor.dtype == torch.bfloat16 else got[name]
        assert ours.shape == tuple(tensor.shape) and ours.dtype == bits(tensor).dtype, name
        np.testing.assert_array_equal(ours, bits(tensor), err_msg=name)
        assert not got[name].flags.writeable                      # a view into the mapped file, not a copy
    assert np.shares_memory(got["rows"], got["base"]) and np.shares_memory(got["column"], got["base"])


def pickled_archive(tmp_path, payload: bytes):
    """A torch checkpoint whose data.pkl is replaced by `payload` (its storages left as torch wrote them)."""
    path = tmp_path / "model.bin"
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as z:
        members = {info.filename: z.read(info) for info in z.infolist()}
    name = next(n for n in members if n.endswith("/data.pkl"))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for member, data in members.items():
            z.writestr(member, payload if member == name else data)
    return path


class Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_a_command_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = pickled_archive(tmp_path, pickle.dumps({"w": Boom(marker)}, protocol=2))
    with pytest.raises(pickle.UnpicklingError):                 # torch's own weights_only refuses it too
        torch.load(path, weights_only=True)
    with pytest.raises(ModelLoadError, match=r"asks for posix\.system.*refusing to load it \(nothing of it was run\)"):
        read_pytorch(str(path))
    assert not marker.exists()


def test_a_whole_module_saved_is_refused_naming_its_class(tmp_path):
    path = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 3), path)
    with pytest.raises(ModelLoadError, match=r"asks for torch\.nn\.modules\.linear\.Linear"):
        read_pytorch(str(path))


@pytest.mark.parametrize("damage, needle", [
    ("legacy", "legacy format"), ("truncated", "not a zip archive"), ("not a dict", "not a state dict of named tensors"),
    ("past the storage", "reads past its storage"), ("garbage pickle", "pickle is not readable"),
])
def test_damaged_checkpoints_are_clear_errors(tmp_path, damage, needle):
    path = tmp_path / "model.pt"
    if damage == "legacy":
        torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    elif damage == "truncated":
        torch.save({"w": torch.ones(100)}, path)
        path.write_bytes(path.read_bytes()[:300])
    elif damage == "not a dict":
        torch.save([torch.ones(2)], path)
    elif damage == "past the storage":                              # a tensor claiming more than its storage
        buffer = io.BytesIO()
        torch.save({"w": torch.ones(2)}, buffer)
        with zipfile.ZipFile(buffer) as z:
            pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
        path = pickled_archive(tmp_path, pkl.replace(b"K\x02\x85", b"K\x09\x85", 1))   # size (2,) -> (9,)
    else:
        path = pickled_archive(tmp_path, b"\x80\x02}q\x00(X\x01")
    with pytest.raises(ModelLoadError, match=needle):
        read_pytorch(str(path))


def test_a_hf_directory_with_pytorch_model_bin_loads_as_its_safetensors_twin(tmp_path):
    from soma_runtime import loaders
    from soma_runtime.tasks import Runtime
    from tests.fixtures.decoders import build_model
    model, _ = build_model("llama", str(tmp_path / "safetensors"))
    build_model("llama", str(tmp_path / "bin"))
    (tmp_path / "bin" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")    # as transformers < 4.35 saved them
    twin, ours = (loaders.load(str(tmp_path / d)).weights.tensors for d in ("safetensors", "bin"))
    assert sorted(twin) == sorted(ours)
    for name in twin:
        np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(twin[name]), err_msg=name)
    runtime = Runtime("cpu")
    texts = [[t.id for t in runtime.load(str(tmp_path / d), progress=False).generate([1, 2, 3], max_tokens=8, temperature=0,
                                                                                     ignore_eos=True)]
             for d in ("safetensors", "bin")]
    assert texts[0] == texts[1]

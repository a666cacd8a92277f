"""Bad files and bad requests end in clear, typed errors that name the problem; nothing crashes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from soma_runtime.errors import ModelLoadError, RequestError, UnsupportedModelError
from soma_runtime.loaders import default_model_path, load
from soma_runtime.loaders.gguf import read_gguf
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny"))
    build_model("llama", directory)
    return directory


def test_truncated_gguf_names_the_file_and_the_tensor(tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(20_000_000))
    with pytest.raises(ModelLoadError, match="cut.gguf.*truncated.*tensor"):
        load(str(cut))


def test_gguf_truncated_inside_the_header(tmp_path):
    cut = tmp_path / "header.gguf"
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(4096))
    with pytest.raises(ModelLoadError, match="truncated in the header"):
        read_gguf(str(cut))


def test_not_a_gguf(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load(str(bogus))


def test_a_tensor_of_the_wrong_size_is_named(tiny_dir, tmp_path):
    from safetensors.numpy import load_file, save_file
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"][:-16]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="blk.1.attn_k.weight.*shape"):
        Runtime().load(str(broken), progress=False)


def test_unknown_model_type_lists_the_supported_ones(tiny_dir, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(tiny_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "mamba9"}))
    with pytest.raises(UnsupportedModelError, match="mamba9.*supported:.*llama.*qwen3"):
        load(str(odd))


def test_missing_model_and_unsupported_file():
    with pytest.raises(ModelLoadError, match="no such file"):
        load("/nonexistent/model.gguf")
    with pytest.raises(ModelLoadError, match="unsupported model file"):
        load(__file__)


def test_prompt_longer_than_the_context_is_rejected(tiny_dir):
    model = Runtime().load(tiny_dir, n_ctx=32, progress=False)
    with pytest.raises(RequestError, match="does not fit the context of 32"):
        list(model.generate(list(range(40)), max_tokens=4))
    with pytest.raises(RequestError, match="max_tokens"):
        list(model.generate("hello", max_tokens=0))
    with pytest.raises(RequestError, match="unknown generation parameter"):
        list(model.generate("hello", temprature=0.5))
    assert list(model.generate("hello", max_tokens=3, temperature=0))      # the model still serves


def test_cli_reports_a_bad_model_path_without_a_traceback():
    r = subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", "run", "--model", "/nope.gguf", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1 and "no such file" in r.stderr and "Traceback" not in r.stderr
    assert os.path.exists(default_model_path())


def test_sha256_is_checked_when_given(tmp_path):
    import hashlib
    path = default_model_path()
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    assert load(path, sha256=digest).format == "gguf"
    with pytest.raises(ModelLoadError, match="sha256"):
        load(path, sha256="0" * 64)


def rewrite_gguf(src: str, dst: str, architecture: str | None = None, shrink: str | None = None) -> str:
    """Copy a GGUF, optionally renaming its architecture or dropping rows from one tensor."""
    import gguf
    import numpy as np

    from soma_runtime.dtypes import QTensor
    from soma_runtime.quant import dequantize
    f = read_gguf(src)
    arch = architecture or f.metadata["general.architecture"]
    w = gguf.GGUFWriter(dst, arch)
    old = f.metadata["general.architecture"]
    for key, value in f.metadata.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        key = key.replace(f"{old}.", f"{arch}.", 1)
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    for name, t in f.tensors.items():
        data = np.asarray(dequantize(t) if isinstance(t, QTensor) else t, np.float32)
        w.add_tensor(name, data[:-8] if name == shrink else np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir, tmp_path_factory):
    from soma_runtime.convert import convert_hf_to_gguf
    return convert_hf_to_gguf(tiny_dir, str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"), "f32")


def test_gguf_with_a_tensor_of_the_wrong_size(tiny_gguf, tmp_path):
    bad = rewrite_gguf(tiny_gguf, str(tmp_path / "bad.gguf"), shrink="blk.1.attn_v.weight")
    with pytest.raises(ModelLoadError, match="bad.gguf.*blk.1.attn_v.weight.*shape"):
        Runtime().load(bad, progress=False)


def test_gguf_with_an_unknown_architecture(tiny_gguf, tmp_path):
    odd = rewrite_gguf(tiny_gguf, str(tmp_path / "odd.gguf"), architecture="mamba9")
    with pytest.raises(UnsupportedModelError, match="mamba9.*supported:.*llama"):
        load(odd)

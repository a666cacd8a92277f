"""Weight integrity: --sha256 pins a GGUF file or a whole model directory (its weight files), everywhere
a model is loaded; a soma config.toml's per-file pins are always checked; tampered weights never run."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from soma_runtime.errors import ModelLoadError
from soma_runtime.loaders import default_model_path
from soma_runtime.loaders.soma import import_hf_dir
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model
from tests.server.conftest import ServerProcess


def cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", *args], capture_output=True, text=True,
                          timeout=300, check=False, input=stdin)


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def directory_digest(directory, names) -> str:
    """The documented definition, computed here independently: `sha256sum <files, sorted> | sha256sum`."""
    lines = "".join(f"{sha256(os.path.join(directory, n))}  {n}\n" for n in sorted(names))
    return hashlib.sha256(lines.encode()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny"))
    build_model("qwen3", directory)
    return directory


def tampered(directory, tmp_path) -> str:
    copy = tmp_path / "tampered"
    shutil.copytree(directory, copy)
    weights = next(n for n in sorted(os.listdir(copy)) if n.endswith(".safetensors"))
    with open(copy / weights, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x01\x02\x03")
    return str(copy)


def test_a_directory_digest_is_sha256sum_of_its_weight_files(tiny_dir):
    r = cli("models", "hash", tiny_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == directory_digest(tiny_dir, ["model.safetensors"])
    assert cli("models", "hash", default_model_path()).stdout.strip() == sha256(default_model_path())


def test_a_tampered_hf_directory_is_refused(tiny_dir, tmp_path):
    digest = directory_digest(tiny_dir, ["model.safetensors"])
    assert Runtime().load(tiny_dir, sha256=digest, progress=False)
    with pytest.raises(ModelLoadError, match="does not match.*refusing"):
        Runtime().load(tampered(tiny_dir, tmp_path), sha256=digest, progress=False)


@pytest.mark.parametrize("value", ["", "abc", "g" * 64, "0" * 63])
def test_a_sha256_that_is_no_digest_is_an_error(tiny_dir, value):
    with pytest.raises(ModelLoadError, match="64 hexadecimal digits"):
        Runtime().load(tiny_dir, sha256=value, progress=False)
    r = cli("run", "--model", tiny_dir, "--sha256", value, "--prompt", "hi")
    assert r.returncode == 2 and "sha256" in r.stderr


def test_soma_directories_pin_their_files_and_are_always_checked(tiny_dir, tmp_path):
    soma = import_hf_dir(tiny_dir, str(tmp_path / "soma"))
    with open(os.path.join(soma, "config.toml")) as f:
        assert sha256(os.path.join(soma, "weights.safetensors")) in f.read()
    model = Runtime().load(soma, progress=False)
    assert len(list(model.generate("Hello", max_tokens=2, temperature=0))) == 2
    with pytest.raises(ModelLoadError, match="weights.safetensors.*does not match.*config.toml"):
        Runtime().load(tampered(soma, tmp_path), progress=False)


@pytest.mark.parametrize("command", [["models", "info"], ["run", "--prompt", "hi", "--max-tokens", "1", "--model"],
                                     ["import"]])
def test_every_command_that_loads_can_verify(tiny_dir, tmp_path, command):
    bad = tampered(tiny_dir, tmp_path)
    digest = directory_digest(tiny_dir, ["model.safetensors"])
    tail = [str(tmp_path / "out")] if command == ["import"] else []
    r = cli(*command, bad, *tail, "--sha256", digest)
    assert r.returncode == 1 and "does not match" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert cli(*command, tiny_dir, *tail, "--sha256", digest).returncode == 0


def test_serve_refuses_a_model_whose_digest_differs():
    server = None
    try:
        with pytest.raises(RuntimeError, match="does not match"):
            server = ServerProcess("--model", default_model_path(), "--sha256", "0" * 64)
    finally:
        if server is not None:
            server.stop()

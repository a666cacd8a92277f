"""Fuzzing the loaders: hundreds of GGUF, safetensors, config.json and config.toml files, mutated from real tiny models
(cut short, bytes flipped, counts made huge, JSON values swapped for hostile ones), each loaded in a
worker whose address space is capped. Every one must load or end in a ModelLoadError: no other
exception, no load past the cap, none hung."""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys

import pytest

from tests.fixtures.decoders import build_model
from tests.hardening.files import safetensors_bytes

MEMORY_CAP = 2 * 2**30          # address space a load may add on top of the worker's own
CASES = {"gguf": 300, "safetensors": 150, "config": 150, "toml": 60}
HOSTILE = [0, -1, 1, 2**31, 2**63, 10**30, 1e308, -1e308, 0.5, "x", "", None, True, [], {}, [[[[1]]]], "\ud800"[0:0] + "\u0000"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mutate_bytes(raw: bytes, rng: random.Random, header: int) -> bytes:
    """One of: a cut, flipped bytes, a huge little-endian count, bytes inserted or dropped; mostly in
    the first `header` bytes, where the sizes and counts live."""
    data = bytearray(raw)
    kind = rng.choice(["truncate", "flip", "count", "insert", "delete"])
    where = rng.randrange(min(header, len(data)) if rng.random() < 0.85 else len(data))
    if kind == "truncate":
        return bytes(data[:where])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(min(header, len(data)))
            data[at] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == "count":
        data[where:where + 8] = struct.pack("<Q", rng.choice([0, 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]))
        return bytes(data[:len(raw)])
    if kind == "insert":
        return bytes(data[:where] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + data[where:])
    return bytes(data[:where] + data[where + rng.randint(1, 16):])


def mutate_json(value, rng: random.Random):
    """The value with one leaf (or branch) replaced by a hostile one."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        return {**value, key: mutate_json(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return value[:i] + [mutate_json(value[i], rng)] + value[i + 1:]
    return rng.choice(HOSTILE)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    from soma_runtime.convert import convert_hf_to_gguf
    from soma_runtime.loaders.soma import import_hf_dir
    root = tmp_path_factory.mktemp("seeds")
    hf = str(root / "hf")
    build_model("qwen2", hf)
    ggufs = [convert_hf_to_gguf(hf, str(root / f"tiny-{t}.gguf"), t) for t in ("f16", "q8_0", "q4_0")]
    soma = import_hf_dir(hf, str(root / "soma"))
    return hf, ggufs, soma


@pytest.fixture(scope="module")
def fuzzed(seeds, tmp_path_factory):
    """The mutated models, as paths to load."""
    hf, ggufs, soma = seeds
    out, rng, paths = tmp_path_factory.mktemp("fuzzed"), random.Random(20261202), []
    for i in range(CASES["gguf"]):
        with open(ggufs[i % len(ggufs)], "rb") as f:
            raw = f.read()
        path = out / f"case-{i}.gguf"
        path.write_bytes(mutate_bytes(raw, rng, header=min(len(raw), 64 * 1024)))
        paths.append(str(path))
    with open(os.path.join(hf, "model.safetensors"), "rb") as f:
        weights = f.read()
    (header_len,) = struct.unpack("<Q", weights[:8])
    header = json.loads(weights[8:8 + header_len])
    for i in range(CASES["safetensors"]):
        directory = out / f"st-{i}"
        shutil.copytree(hf, directory)
        if rng.random() < 0.5:
            mutated = mutate_bytes(weights, rng, header=8 + header_len)
        else:
            mutated = safetensors_bytes(mutate_json(header, rng), weights[8 + header_len:])
        (directory / "model.safetensors").write_bytes(mutated)
        paths.append(str(directory))
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    for i in range(CASES["config"]):
        directory = out / f"config-{i}"
        shutil.copytree(hf, directory)
        text = json.dumps(mutate_json(config, rng)).encode()
        (directory / "config.json").write_bytes(mutate_bytes(text, rng, len(text)) if rng.random() < 0.3 else text)
        paths.append(str(directory))
    with open(os.path.join(soma, "config.toml"), "rb") as f:
        toml = f.read()
    for i in range(CASES["toml"]):
        directory = out / f"soma-{i}"
        shutil.copytree(soma, directory)
        (directory / "config.toml").write_bytes(mutate_bytes(toml, rng, len(toml)))
        paths.append(str(directory))
    return paths


def test_every_mutated_model_loads_or_is_a_model_load_error(fuzzed):
    assert len(fuzzed) >= 500
    run = subprocess.run([sys.executable, "-m", "tests.hardening.fuzz_worker", str(MEMORY_CAP), *fuzzed], cwd=REPO,
                         capture_output=True, text=True, timeout=900, check=False)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and len(results) == len(fuzzed), run.stderr[-3000:]
    bad = [r for r in results if r["outcome"] not in ("loaded", "ModelLoadError")]
    assert not bad, bad[:10]
    outcomes = {r["outcome"] for r in results}
    assert outcomes == {"loaded", "ModelLoadError"}           # the mutations reach both ends

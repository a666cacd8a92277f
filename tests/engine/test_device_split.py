"""A decoder split across devices (llama.cpp's --n-gpu-layers): its first layers on the CUDA backend, the
rest on the host, the hidden rows passing between. Logits against transformers' and the CPU backend's in
the same run, greedy tokens against the CPU's, alone, batched and speculating; each layer's pages where
its stage runs. On CI the CUDA kernels run in Triton's interpreter (one layer of two stays quick)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from soma_runtime.engine.generate.batching import Scheduler
from soma_runtime.errors import RequestError
from soma_runtime.tasks import Runtime
from tests.backends import BACKENDS
from tests.engine.test_batching import run_all
from tests.fixtures.decoders import build_model

pytestmark = pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")
PROMPTS = ["The quick brown fox jumps over", "Hello world, this is", "Numbers 12345 and"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen2"))
    hf_model, _ = build_model("qwen2", directory)
    return directory, hf_model, Runtime("cpu").load(directory, progress=False)


@pytest.mark.parametrize("gpu_layers", [0, 1])
def test_a_split_model_computes_what_transformers_and_the_cpu_do(tiny, gpu_layers):
    directory, hf_model, cpu = tiny
    model = Runtime("cuda").load(directory, progress=False, gpu_layers=gpu_layers)
    stages = [(s.layers, s.backend.name) for s in model.engine.stages]
    assert stages == ([(range(2), "cpu")] if gpu_layers == 0 else [(range(1), "cuda"), (range(1, 2), "cpu")])
    assert model.info()["gpu_layers"] == gpu_layers
    pages = model.engine.pool.k
    assert isinstance(pages[1], np.ndarray) and isinstance(pages[0], np.ndarray) == (gpu_layers == 0)
    ids = cpu.tokenize(PROMPTS[0])
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = model.logits(ids)
    assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, cpu.logits(ids), atol=1e-4)
    greedy = {"max_tokens": 8, "temperature": 0}
    assert [t.id for t in model.generate(ids, **greedy)] == [t.id for t in cpu.generate(ids, **greedy)]


def test_split_streams_batch_and_speculate_with_their_solo_tokens(tiny):
    directory, _, cpu = tiny
    model = Runtime("cuda").load(directory, progress=False, gpu_layers=1)
    ids = [cpu.tokenize(p) for p in PROMPTS]
    solo = [[t.id for t in cpu.generate(x, max_tokens=6, temperature=0)] for x in ids]
    assert not model.engine.asynchronous               # the host stage waits for the device's rows
    scheduler = Scheduler(model.engine, max_batch=4, step_tokens=32)
    try:
        assert run_all(scheduler, [model.request(x, 6, temperature=0) for x in ids]) == solo
        assert scheduler.stats.max_batch > 1
    finally:
        scheduler.close()
    model.speculate("layers:1")                         # the draft: the device's layer, then the head
    assert [(s.layers, s.backend.name) for s in model.scheduler.drafter.engine.stages] == [(range(1), "cuda")]
    assert [t.id for t in model.generate(ids[0], max_tokens=6, temperature=0)] == solo[0]
    assert model.metrics()["drafted_tokens"] > 0


def test_offloading_layers_moves_their_weights_and_cache_to_the_host(tiny):
    directory, _, cpu = tiny
    model = Runtime("cuda").load(directory, progress=False)
    engine = model.engine
    whole = model.memory_bytes
    assert engine.device_layers == 2 and whole == model.weight_bytes() + pool_bytes(engine, range(2))
    model.offload(1)
    assert engine.device_layers == 1 and model.memory_bytes == engine.memory_bytes(1) < whole
    assert model.memory_bytes - pool_bytes(engine, range(1)) < model.weight_bytes()
    assert isinstance(engine.pool.k[1], np.ndarray) and not isinstance(engine.pool.k[0], np.ndarray)
    ids = cpu.tokenize(PROMPTS[1])
    assert [t.id for t in model.generate(ids, max_tokens=6, temperature=0)] == \
        [t.id for t in cpu.generate(ids, max_tokens=6, temperature=0)]


def pool_bytes(engine, layers: range) -> int:
    """The bytes of the KV pages `layers` hold, as allocated."""
    return sum(int(pages[i].nbytes) for pages in (engine.pool.k, engine.pool.v) for i in layers)


def test_gpu_layers_needs_a_device_and_a_decoder(tiny):
    directory, _, _ = tiny
    with pytest.raises(RequestError, match="no device"):
        Runtime("cpu").load(directory, progress=False, gpu_layers=1)
    with pytest.raises(RequestError, match="gpu_layers"):
        Runtime("cuda").load(directory, progress=False, gpu_layers=-1)

"""Tensor parallel on the host: a decoder split over 2 and 4 processes (gloo) computes the logits and
greedy tokens of one process, for tiny families of each head layout (GQA, biases, tied embeddings,
fused q/k/v and gate/up) and for the bundled SmolLM2 GGUF (real weights, quantized blocks split on their
boundaries, 3 ranks); batched streams; the ranks stop with the model, or fail the step with a typed
error when one dies; what cannot be split says why before any process starts."""
from __future__ import annotations

import time

import numpy as np
import pytest

from soma_runtime import parallel
from soma_runtime.engine.generate.batching import Scheduler
from soma_runtime.errors import ParallelError, RequestError
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.server.registry import ModelRegistry
from soma_runtime.tasks import Runtime
from tests.engine.test_batching import run_all
from tests.fixtures.decoders import build_model

EXACT = {"kv_dtype": "f32", "activations": "f32", "progress": False}
GREEDY = {"max_tokens": 8, "temperature": 0}
PROMPT = list(range(5, 40))


@pytest.fixture(scope="module")
def runtime():
    return Runtime("cpu", threads=1)


@pytest.fixture(scope="module")
def families(tmp_path_factory, runtime):
    """Per family: its directory and its one-process model (8 heads sharing 4 kv heads)."""
    built = {}
    for family in ("llama", "qwen2", "gemma", "phi3"):
        directory = str(tmp_path_factory.mktemp(family))
        build_model(family, directory, num_attention_heads=8, num_key_value_heads=4)
        built[family] = directory, runtime.load(directory, **EXACT)
    return built


def stopped(runtime, model) -> list:
    """Unload a split model; its followers' exit codes."""
    processes = model.followers.processes
    runtime.unload(model.id)
    return [p.returncode for p in processes]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "phi3"])
def test_ranks_compute_the_logits_and_tokens_of_one_process(runtime, families, family, ranks):
    directory, whole = families[family]
    model = runtime.load(directory, tensor_parallel=ranks, **EXACT)
    assert model.engine.cfg.num_heads == 8 // ranks and model.engine.pool.k[0].shape[2] == 4 // ranks
    assert model.info()["tensor_parallel"] == ranks and model.info()["heads"] == 8
    want = whole.logits(PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max())))
    assert [t.id for t in model.generate(PROMPT, **GREEDY)] == [t.id for t in whole.generate(PROMPT, **GREEDY)]
    assert stopped(runtime, model) == [0] * (ranks - 1)


def test_batched_streams_on_ranks_get_their_solo_tokens(runtime, families):
    directory, whole = families["qwen2"]
    model = runtime.load(directory, tensor_parallel=2, **EXACT)
    prompts = [PROMPT[:n] for n in (5, 17, 30)]
    requests = [model.request(p, max_tokens=6, temperature=0) for p in prompts]
    scheduler = Scheduler(model.engine, 4, 64)
    got = run_all(scheduler, requests)
    scheduler.close()
    assert got == [[t.id for t in whole.generate(p, max_tokens=6, temperature=0)] for p in prompts]
    stopped(runtime, model)


def test_smollm2_on_three_ranks_splits_its_quantized_blocks_and_answers_alike(runtime):
    whole = runtime.load("default", **EXACT)
    model = runtime.load("default", tensor_parallel=3, **EXACT)
    o_proj = model.engine.weights["blk.0.attn_output.weight"]
    assert o_proj.dtype.name == "q4_1" and o_proj.shape == (576, 192)            # 9 heads of 64 -> 3 a rank
    ids = whole.tokenize("The capital of France is")
    want = whole.logits(ids)
    np.testing.assert_allclose(model.logits(ids), want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
    assert [t.id for t in model.generate(ids, **GREEDY)] == [t.id for t in whole.generate(ids, **GREEDY)]
    stopped(runtime, model)
    runtime.unload(whole.id)


def test_ranks_wait_for_the_next_step_past_their_collectives_deadline(runtime, families, monkeypatch):
    """An idle server's ranks await rank 0's next step however long (only a step's collectives have a deadline)."""
    monkeypatch.setattr(parallel, "JOIN_TIMEOUT_S", 20.0)          # (long enough for the ranks to start)
    directory, whole = families["llama"]
    model = runtime.load(directory, tensor_parallel=2, **EXACT)
    time.sleep(22)
    assert [t.id for t in model.generate(PROMPT, **GREEDY)] == [t.id for t in whole.generate(PROMPT, **GREEDY)]
    assert stopped(runtime, model) == [0]


def test_a_rank_that_dies_fails_the_next_step_with_a_typed_error(runtime, families):
    model = runtime.load(families["llama"][0], tensor_parallel=2, **EXACT)
    model.followers.processes[0].kill()
    model.followers.processes[0].wait()
    with pytest.raises(ParallelError, match="broke off"):
        model.logits(PROMPT)
    runtime.unload(model.id)


def test_what_cannot_be_split_says_why(runtime, families):
    with pytest.raises(ParallelError, match="4 kv heads cannot be shared by 8 ranks"):
        runtime.load(families["llama"][0], tensor_parallel=8, **EXACT)
    for bad in (0, "2"):                                # refused at the API's edge, before any rank starts
        with pytest.raises(RequestError, match="tensor_parallel must be an integer >= 1"):
            runtime.load(families["llama"][0], tensor_parallel=bad, **EXACT)
    g = GraphBuilder()
    graph = g.output(g.relu(g.input("x", (2,), "f32")))
    with pytest.raises(RequestError, match="splits text generators"):
        runtime.load(graph, tensor_parallel=2)
    with pytest.raises(RequestError, match="do not go together"):
        runtime.load(families["llama"][0], tensor_parallel=2, gpu_layers=1, **EXACT)


def test_a_server_splits_its_text_models_and_stops_the_ranks_with_them(runtime, families):
    directory, whole = families["phi3"]
    registry = ModelRegistry(runtime, tensor_parallel=2, kv_dtype="f32")
    served = registry.load(directory, "split")
    model = served.model
    assert model.engine.shard.ranks == 2 and model.smaller_kv_kind() is None      # the ladder's compression passes it by
    processes = model.followers.processes
    request = model.request(PROMPT, max_tokens=8, temperature=0)
    assert run_all(served.scheduler, [request]) == [[t.id for t in whole.generate(PROMPT, **GREEDY)]]
    registry.unload("split")
    served.drained.wait(30)
    assert [p.returncode for p in processes] == [0]


def test_a_compressed_cache_on_ranks_keeps_each_heads_center_and_the_logits(runtime, tmp_path):
    build_model("qwen2", str(tmp_path), num_attention_heads=8, num_key_value_heads=4, head_dim=32, hidden_size=128)
    coded = {**EXACT, "kv_dtype": "tq4"}
    whole = runtime.load(str(tmp_path), **coded)
    model = runtime.load(str(tmp_path), tensor_parallel=2, **coded)
    np.testing.assert_allclose(model.engine.key_centers[0], whole.engine.key_centers[0][:2], atol=1e-5)   # rank 0's heads
    want = whole.logits(PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max())))
    stopped(runtime, model)

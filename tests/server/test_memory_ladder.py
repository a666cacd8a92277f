"""The memory ladder under --memory-budget: budgets set so that each rung is forced in turn while
requests run. A model's KV cache is compressed under a running request (its pages converted where
they lie: the request goes on to its end); models are unloaded only after their requests end
(tests/server/test_registry.py); a new model on a device runs its last layers on the host; a new
model's context is cut to what is left. Every rung is logged
and counted in /v1/metrics, /v1/memory and `soma-runtime memory`."""
from __future__ import annotations

import queue
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from soma_runtime.architectures.decoder import cache_of
from soma_runtime.engine.generate.stages import stage_bytes
from soma_runtime.engine.kv import Sequence, pool_slots
from soma_runtime.errors import PromptTooLong
from soma_runtime.quant import kv
from soma_runtime.server.registry import ModelRegistry
from soma_runtime.tasks import Runtime
from tests.backends import BACKENDS
from tests.fixtures.decoders import build_model
from tests.server.conftest import ServerProcess


@pytest.fixture(scope="module")
def footprint():
    """The bundled model's weights and the KV bytes of a pool of its full context in each kind."""
    model = Runtime().load("default", progress=False)
    slots = pool_slots(model.engine.n_ctx)
    return model.weight_bytes(), {kind: cache_of(model.engine.cfg, kind).token_bytes() * slots for kind in ("f16", "tq4", "tq3")}


def pool_bytes(engine) -> int:
    """The bytes of the KV pages a model holds, as allocated."""
    return sum(int(pages.nbytes) for pages in (*engine.pool.k, *engine.pool.v))


def drain(inbox: queue.Queue) -> list:
    items = [inbox.get(timeout=120)]
    while items[-1] is not None:
        items.append(inbox.get(timeout=120))
    return items[:-1]


def test_a_kv_cache_is_compressed_under_a_running_request(footprint):
    weights, cache = footprint
    reg = ModelRegistry(Runtime(), memory_budget=2 * weights + cache["f16"] + cache["tq4"] + 2**20)
    try:
        a = reg.load(None, "a")
        model, inbox = a.model, queue.Queue()
        a.scheduler.submit(model.request(model.tokenize("Tell me a long story about a dragon."), 96, temperature=0,
                                         ignore_eos=True), inbox.put)
        first = inbox.get(timeout=120)
        assert first is not None and not isinstance(first, Exception)
        reg.load(None, "b")                                  # a's cache (the first of the largest) is compressed
        tokens = [first, *drain(inbox)]
        assert not any(isinstance(t, Exception) for t in tokens) and len(tokens) == 96
        assert model.engine.kv_dtype == "tq4" and reg.models["b"].model.engine.kv_dtype == "f16"
        assert reg.degradations == {"compress_kv": 1} and reg.used_bytes <= reg.budget
        assert a.bytes == model.memory_bytes == weights + pool_bytes(model.engine) < weights + cache["f16"]
        assert model.engine.pool.in_use == 0
        prompt = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is"
        assert "Madrid" in model.detokenize([t.id for t in model.generate(prompt, max_tokens=4, temperature=0)])
    finally:
        reg.close()


def test_a_new_models_context_is_cut_to_what_the_budget_leaves(footprint):
    """On the host (on a device, offloading layers comes first: the test below)."""
    weights, cache = footprint
    reg = ModelRegistry(Runtime("cpu"), memory_budget=weights + cache["tq3"] // 2)
    try:
        model = reg.load(None, "small").model
        assert model.engine.kv_dtype == "tq3"
        assert reg.degradations == {"compress_kv": 2, "reduce_context": 1}
        assert 256 <= model.engine.n_ctx < 2100 and reg.used_bytes <= reg.budget
        assert reg.used_bytes == weights + pool_bytes(model.engine)          # the pool cut with the context
        with pytest.raises(PromptTooLong):
            model.request(model.tokenize("word " * 2500), 8)
        assert model.generate("Hello", max_tokens=4, temperature=0)
    finally:
        reg.close()


def test_recompressing_converts_the_pages_sequences_hold():
    """The pages a sequence holds are their old values re-encoded (keys less their center, in the rotated
    basis); tq4 to tq3 re-codes the decoded values."""
    model = Runtime().load("default", kv_dtype="f16", progress=False)
    engine = model.engine
    seq = Sequence()
    engine.forward([(seq, model.tokenize("The quick brown fox jumps over the lazy dog again and again"), 1)])
    fetch = engine.backend.fetch
    held, before = seq.pages, [np.asarray(fetch(p))[seq.pages] for p in engine.pool.pages]
    engine.recompress("tq4")
    rotation = kv.rotation(engine.cfg.head_dim)
    for i, (old, new) in enumerate(zip(before, engine.pool.pages)):
        center = engine.cache.key_center(i // 2) if i % 2 == 0 else 0      # keys less their center
        assert np.array_equal(np.asarray(fetch(new))[held], kv.encode("tq4", (old.astype(np.float32) - center) @ rotation))
    tq4 = [np.asarray(fetch(p))[held] for p in engine.pool.pages]
    engine.recompress("tq3")
    for old, new in zip(tq4, engine.pool.pages):
        assert np.array_equal(np.asarray(fetch(new))[held], kv.encode("tq3", kv.decode("tq4", old)))
    engine.forward([(seq, [1], 1)])                       # the sequence goes on in the new cache
    engine.pool.release(seq)


def test_a_server_under_its_budget_compresses_answers_and_reports_the_rung(footprint):
    import openai
    weights, cache = footprint
    budget_gib = (2 * weights + cache["f16"] + cache["tq4"] + 2**20) / 2**30
    server = ServerProcess("-m", "a=default", "-m", "b=default", "--memory-budget", f"{budget_gib:.6f}", "--max-batch", "4")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        def ask(model: str) -> str:
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a color."}],
                                                   max_tokens=16, temperature=0)
            return reply.choices[0].message.content
        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(ask, ["a", "b", "a", "b"]))
        metrics = server.get("/v1/metrics")[1].splitlines()
        assert 'soma_memory_degradations_total{step="compress_kv"} 1' in metrics
        assert 'soma_memory_degradations_total{step="unload_model"} 0' in metrics
        status, memory = server.get("/v1/memory")
        assert status == 200 and memory["degradations"] == {"compress_kv": 1}
        assert [m["kv_cache"] for m in memory["models"]] == ["tq4", "f16"]
        shown = subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", "memory", "--url", server.url],
                               check=False, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "compress_kv x1" in shown.stdout and "kv tq4" in shown.stdout
        assert "memory budget: compressing the KV cache of a" in server.output()
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")
@pytest.mark.parametrize("context", [None, 400])
def test_a_model_over_the_device_budget_runs_its_last_layers_on_the_host(context, tmp_path):
    """With no cache to compress (16-wide heads) and no model to unload, a new model on the device keeps
    there the layers that fit, the rest on the host; where even one layer does not fit with its whole
    context, its context is cut too. Its requests then run with the CPU's tokens."""
    build_model("qwen2", str(tmp_path), max_position_embeddings=1024)
    cpu = Runtime("cpu").load(str(tmp_path), progress=False)
    engine = cpu.engine
    device_part = stage_bytes(engine.cfg, engine.weights, engine.cache, range(1), pool_slots(context or engine.n_ctx))  # layer 0
    assert device_part < cpu.memory_bytes
    reg = ModelRegistry(Runtime("cuda"), memory_budget=device_part + 1024)
    try:
        model = reg.load(str(tmp_path), "m").model
        cut = {"reduce_context": 1} if context else {}
        assert reg.degradations == {"offload_layers": 1, **cut} and model.engine.device_layers == 1
        assert (context or 1024) <= model.engine.n_ctx < (context or 1024) + 8 and reg.used_bytes <= device_part + 1024
        assert reg.memory()["models"][0]["gpu_layers"] == 1
        ids, inbox = cpu.tokenize("Hello world, this is"), queue.Queue()
        reg.models["m"].scheduler.submit(model.request(ids, 6, temperature=0), inbox.put)
        assert [t.id for t in drain(inbox)] == [t.id for t in cpu.generate(ids, max_tokens=6, temperature=0)]
    finally:
        reg.close()

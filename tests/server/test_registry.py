"""The model registry's memory budget: a model that does not fit, its KV caches compressed as far as
they go, unloads the least recently used model of no higher priority; one that cannot fit is refused
with a clear error (tests/server/test_memory_ladder.py takes the ladder's other rungs)."""
from __future__ import annotations

import pytest

from soma_runtime.architectures.decoder import cache_of
from soma_runtime.engine.kv import pool_slots
from soma_runtime.server.registry import ModelRegistry, OutOfMemory
from soma_runtime.tasks import Runtime


@pytest.fixture(scope="module")
def size():
    """The bundled model's smallest footprint: its weights and a pool of one context (as under a budget) of
    the ladder's last KV kind."""
    reg = ModelRegistry(Runtime())
    model = reg.load(None, "probe").model
    yield model.weight_bytes() + pool_slots(model.engine.n_ctx) * cache_of(model.engine.cfg, "tq3").token_bytes()
    reg.close()


def test_loading_past_the_budget_evicts_the_least_recently_used(size):
    reg = ModelRegistry(Runtime(), memory_budget=int(2.5 * size))
    try:
        reg.load(None, "a")
        reg.load(None, "b")
        reg.get("a")                                  # a is now more recent than b
        reg.load(None, "c")
        assert sorted(reg.models) == ["a", "c"] and reg.evicted == 1
        assert sorted(reg.runtime.models) == ["a", "c"]
    finally:
        reg.close()


def test_higher_priority_models_are_never_evicted_for_lower(size):
    reg = ModelRegistry(Runtime(), memory_budget=int(1.5 * size))
    try:
        reg.load(None, "important", priority=5)
        with pytest.raises(OutOfMemory, match="higher priority"):
            reg.load(None, "casual", priority=0)
        reg.load(None, "urgent", priority=9)
        assert list(reg.models) == ["urgent"]
    finally:
        reg.close()


def test_a_model_bigger_than_the_budget_is_refused(size):
    reg = ModelRegistry(Runtime(), memory_budget=size // 2)
    with pytest.raises(OutOfMemory, match="whole budget"):
        reg.load(None, "big")
    assert not reg.models


def test_the_budget_counts_an_unloaded_model_until_it_has_finished_its_requests(size):
    import queue
    reg = ModelRegistry(Runtime(), memory_budget=int(1.5 * size))
    try:
        served = reg.load(None, "a")
        inbox = queue.Queue()
        model = served.model
        served.scheduler.submit(model.request(model.tokenize("Tell a long story."), 60, temperature=0), inbox.put)
        assert inbox.get(timeout=60) is not None                     # it is generating
        reg.unload("a")
        assert "a" not in reg.models and reg.used_bytes == served.bytes  # still live: finishing its request
        reg.load(None, "b")                                          # waits for a to drain, then fits
        assert served.drained.is_set() and reg.used_bytes == reg.models["b"].bytes
        items = [inbox.get(timeout=60)]
        while items[-1] is not None:                                 # its request ran to its end
            items.append(inbox.get(timeout=60))
        assert not any(isinstance(item, Exception) for item in items)
    finally:
        reg.close()

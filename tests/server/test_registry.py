"""The model registry's memory budget: a model that does not fit unloads the least recently used
model of no higher priority; one that cannot fit is refused with a clear error."""
from __future__ import annotations

import pytest

from soma_runtime.api import Runtime
from soma_runtime.server.registry import ModelRegistry, OutOfMemory


@pytest.fixture(scope="module")
def size():
    reg = ModelRegistry(Runtime())
    yield reg.load(None, "probe").bytes
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

"""Plans: passes, shape binding, the memory planner, and repeated runs."""
from __future__ import annotations

import numpy as np
import pytest

from soma_runtime.backends import get
from soma_runtime.errors import GraphError
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.ir.plan import Plan
from tests.fixtures.toy import toy_decoder

CPU = get("cpu")


def decoder_inputs(seq=7, seed=0):
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(0, 50, seq).astype(np.int64), "positions": np.arange(seq, dtype=np.int64)}


def test_memory_plan_reuses_buffers_in_a_12_layer_decoder():
    plan = Plan.for_inputs(toy_decoder(layers=12), CPU, decoder_inputs())
    assert plan.memory.arena_bytes < plan.memory.total_bytes / 4, (plan.memory.arena_bytes, plan.memory.total_bytes)


def test_results_are_unchanged_with_planning_on_and_off():
    graph, inputs = toy_decoder(layers=12), decoder_inputs()
    planned = Plan.for_inputs(graph, CPU, inputs).run(inputs)[0]
    unplanned = Plan.for_inputs(graph, CPU, inputs, memory_plan=False).run(inputs)[0]
    np.testing.assert_array_equal(planned, unplanned)


def test_planned_cpu_decoder_matches_the_reference_atoms():
    graph, inputs = toy_decoder(layers=2), decoder_inputs(seq=5)
    cpu = Plan.for_inputs(graph, CPU, inputs).run(inputs)[0]
    atoms = Plan.for_inputs(graph, get("reference"), inputs).run(inputs)[0]
    np.testing.assert_allclose(cpu, atoms, atol=1e-4 * max(1, np.abs(atoms).max()), rtol=0)


def test_a_plan_runs_many_times_and_outputs_do_not_alias_the_arena():
    graph = toy_decoder(layers=2)
    first, second = decoder_inputs(seed=1), decoder_inputs(seed=2)
    plan = Plan.for_inputs(graph, CPU, first)
    out1 = plan.run(first)[0]
    out1_copy = out1.copy()
    plan.run(second)
    np.testing.assert_array_equal(out1, out1_copy)
    np.testing.assert_array_equal(plan.run(first)[0], out1_copy)


def test_dead_nodes_are_removed_and_constants_folded():
    g = GraphBuilder()
    x = g.input("x", (4,), "f32")
    a = g.const("a", np.full(4, 2.0, np.float32))
    b = g.const("b", np.full(4, 3.0, np.float32))
    folded = g.mul(a, b)                       # constant: folded at plan time
    g.relu(x)                                  # dead: nothing reads it
    graph = g.output(g.add(x, folded))
    plan = Plan(graph, CPU)
    assert [s.kernel.__name__ for s in plan.steps] == ["add"]
    np.testing.assert_array_equal(plan.run({"x": np.ones(4, np.float32)})[0], np.full(4, 7.0, np.float32))


def test_wrong_input_shape_raises():
    graph, inputs = toy_decoder(layers=1), decoder_inputs(seq=4)
    plan = Plan.for_inputs(graph, CPU, inputs)
    with pytest.raises(GraphError, match="'ids'"):
        plan.run(decoder_inputs(seq=5))
    with pytest.raises(GraphError, match="rank"):
        Plan.for_inputs(graph, CPU, {"ids": np.zeros((2, 2), np.int64), "positions": np.zeros(2, np.int64)})


def test_views_keep_their_source_buffer_alive():
    # split's outputs are views of the matmul result: the planner must not reuse that buffer early
    g = GraphBuilder()
    x = g.input("x", (3, 4), "f32")
    w = g.const("w", np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32))
    a, b = g.split(g.matmul(x, w, transpose_b=True), sizes=(2, 4), axis=-1)
    later = g.relu(g.matmul(x, w, transpose_b=True))          # wants an arena buffer meanwhile
    graph = g.output(g.add(g.concat(a, g.slice(b, axis=-1, start=0, stop=2), axis=-1), g.slice(later, axis=-1, start=0, stop=4)))
    inputs = {"x": np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)}
    np.testing.assert_array_equal(Plan(graph, CPU).run(inputs)[0], Plan(graph, CPU, memory_plan=False).run(inputs)[0])


def test_views_of_the_arena_are_made_once_at_plan_time():
    """A split or reshape of an arena buffer is the same view every run: it leaves the run loop, and
    runs with new inputs see the new values through it. A reshape that must copy stays a step."""
    g = GraphBuilder()
    x = g.input("x", (3, 4), "f32")
    w = g.const("w", np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32))
    a, b = g.split(g.relu(g.matmul(x, w, transpose_b=True)), sizes=(1, 2), axis=0)
    copied = g.reshape(g.slice(b, axis=-1, start=0, stop=3), shape=(6,))        # strided: a copy
    graph = g.output(g.add(g.reshape(a, shape=(6,)), copied))
    plan, reference = Plan(graph, CPU), Plan(graph, CPU, memory_plan=False)
    assert [step.kernel.__name__ for step in plan.steps].count("reshape") == 1
    assert "split" not in [step.kernel.__name__ for step in plan.steps]
    for seed in (1, 2):
        inputs = {"x": np.random.default_rng(seed).standard_normal((3, 4)).astype(np.float32)}
        np.testing.assert_array_equal(plan.run(inputs)[0], reference.run(inputs)[0])


class Watched(np.ndarray):
    """An array a weak reference can follow (plain ndarrays take none)."""


def test_without_an_arena_an_intermediate_goes_after_its_last_reader():
    """A device backend's plan has no arena: each intermediate must be let go once no later step reads
    it, so a step holds what is live, not all that the run has computed."""
    import weakref
    g = GraphBuilder()
    x = g.input("x", (64,), "f32")
    first = g.relu(x)
    second = g.add(first, first)                  # first's last reader
    graph = g.output(g.add(g.relu(second), second))
    plan = Plan(graph, CPU, memory_plan=False)
    kernels = [step.kernel for step in plan.steps]
    seen = {}

    def watch(k, kernel):
        def run(*args, **kwargs):
            if k == 2:                            # relu(second): first's reader has run
                seen["first alive"] = seen["first"]() is not None
            result = np.asarray(kernel(*args, **kwargs)).view(Watched)
            if k == 0:
                seen["first"] = weakref.ref(result)
            return result
        return run
    for k, step in enumerate(plan.steps):
        step.kernel = watch(k, kernels[k])
    inputs = {"x": np.random.default_rng(0).standard_normal(64).astype(np.float32)}
    out = plan.run(inputs)[0]
    assert seen["first alive"] is False
    np.testing.assert_allclose(out, Plan(graph, CPU).run(inputs)[0])


def test_a_models_plans_share_its_weights_on_a_device(tmp_path):
    """Every plan of a model reads the same device copy of each weight (a copy a plan held an 8B
    model's 16 GB once a plan)."""
    from tests.backends import BACKENDS
    if "cuda" not in BACKENDS:
        pytest.skip("needs a GPU or Triton (interpreted)")
    from soma_runtime.tasks import Runtime
    from tests.fixtures.decoders import build_model
    build_model("qwen2", str(tmp_path))
    engine = Runtime("cuda").load(str(tmp_path), progress=False).engine
    one, many = engine.plan(1), engine.plan(7, 2)
    weights = [name for name in one.graph.constants if name.startswith("blk.") and name in many.graph.constants]
    assert weights and all(one.graph.constants[n] is many.graph.constants[n] for n in weights)


def test_prompts_too_large_for_free_device_memory_run_in_chunks_with_the_same_tokens(smol, monkeypatch):
    ids = smol.tokenize("Write a poem about the moon, the sea and the stars, in three short verses.")
    expected = [t.id for t in smol.generate(ids, max_tokens=6, temperature=0)]
    steps, launch = [], smol.engine.launch

    def counted(batch, *args, **kwargs):
        steps.append(sum(len(tokens) for _, tokens, _ in batch))
        return launch(batch, *args, **kwargs)
    monkeypatch.setattr(smol.engine.backend, "free_bytes", lambda: 10**7)   # half of it is a step's: 5 MB ...
    monkeypatch.setattr(smol.engine, "row_bytes", 2 * 10**6)            # ... for rows of 2 MB each
    monkeypatch.setattr(smol.engine, "launch", counted)
    assert smol.engine.step_rows(len(ids)) == 2
    smol.engine.pool.clear_prefix_cache()                              # the whole prompt runs again
    assert [t.id for t in smol.generate(ids, max_tokens=6, temperature=0)] == expected
    assert max(steps) == 2 and sum(steps) == len(ids) + len(expected) - 1


def test_a_size_only_the_data_decides_is_planned_and_known_when_its_node_has_run():
    """range's length comes from its inputs' values: one plan runs every length, each result
    equal to numpy's, and the tensors it sizes stay out of the arena."""
    g = GraphBuilder()
    start, limit, delta = (g.input(n, (), "f32") for n in ("start", "limit", "delta"))
    values = g.range(start, limit, delta)
    doubled = g.mul(values, g.const("two", np.full(1, 2.0, np.float32)))
    graph = g.output(doubled, g.reduce_sum(doubled, axes=None))
    plan = Plan(graph, CPU)
    for a, b, step in ((0.0, 5.0, 1.0), (1.0, 2.0, 0.25), (3.0, -1.0, -0.5)):
        want = np.arange(a, b, step, dtype=np.float32) * 2
        out, total = plan.run({"start": np.float32(a), "limit": np.float32(b), "delta": np.float32(step)})
        np.testing.assert_allclose(out, want, rtol=1e-6)
        np.testing.assert_allclose(total, want.sum(), rtol=1e-5)
    assert doubled.name not in plan.memory.offsets

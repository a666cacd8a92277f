"""Programs: one graph's plans kept within bounds, its compiled steps, the loop they replace."""
from __future__ import annotations

import numpy as np
import pytest

from soma_runtime.backends import get
from soma_runtime.errors import RequestError
from soma_runtime.ir.backend import Captures
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.ir.plan import Plan
from soma_runtime.ir.program import Program
from tests.fixtures.toy import toy_decoder

CPU = get("cpu")


def scaled_sum():
    """A graph whose intermediates live in its plans' arenas (a softmax between two elementwise ops)."""
    g = GraphBuilder()
    x = g.input("x", ("B", 16), "f32")
    return g.output(g.relu(g.softmax(g.mul(x, x))))


class Recording(Captures):
    def __init__(self):
        self.forgotten = []

    def forget(self, plan) -> None:
        self.forgotten.append(plan)


class Host(type(CPU)):
    """The CPU backend whose captures record what they are told to forget."""
    def captures(self) -> Captures:
        return Recording()


def test_plans_are_kept_per_binding_within_the_count_and_the_dropped_ones_are_forgotten():
    program = Program(scaled_sum(), Host(), kept=3)
    plans = [program.plan({"B": b}) for b in (1, 2, 3, 4, 5)]
    assert list(program.plans.values()) == plans[2:]
    assert program.captures.forgotten == plans[:2]
    assert program.plan({"B": 5}) is plans[4]                  # kept: not planned again
    program.plan({"B": 3})                                      # used last: the next one drops 4's
    program.plan({"B": 6})
    assert [p.bindings["B"] for p in program.plans.values()] == [5, 3, 6]


def test_plans_past_the_arena_budget_are_dropped_oldest_first_but_one_is_always_kept():
    program = Program(scaled_sum(), CPU, arena_bytes=4096)
    program.plan({"B": 8}), program.plan({"B": 16})           # 512 and 1024 bytes an intermediate
    big = program.plan({"B": 1024})                             # alone past the budget
    assert list(program.plans.values()) == [big]


def test_every_plan_of_a_program_reads_the_same_placed_weights():
    program = Program(toy_decoder(layers=2), CPU)
    one, two = program.plan({"S": 3}), program.plan({"S": 5})
    shared = [n for n in one.graph.constants if n in two.graph.constants]
    assert shared and all(one.graph.constants[n] is two.graph.constants[n] for n in shared)


class Device(type(CPU)):
    """The CPU backend as a device backend: constants placed (copied) once a program, results fetched."""
    device = True

    def place(self, value):
        return np.array(value)


def test_a_constant_folded_at_one_plans_sizes_is_not_read_by_another_plan():
    """A constant expanded to the batch folds per plan (an exported mask's range over the batch): each plan
    places its own, while the graph's own constants are placed once for all."""
    g = GraphBuilder()
    x = g.input("x", ("B",), "f32")
    weight = g.const("weight", np.arange(4, dtype=np.float32))
    count = g.reduce_sum(g.expand(g.const("one", np.ones(1, np.float32)), shape=("B",)))      # B, folded
    graph = g.output(g.add(g.mul(x, count), g.reduce_sum(weight)))
    program = Program(graph, Device())
    for b in (1, 3, 1):
        assert program.run({"B": b}, {"x": np.full(b, 2, np.float32)})[0].tolist() == [2.0 * b + 6] * b
    one, three = program.plan({"B": 1}), program.plan({"B": 3})
    assert one.graph.constants["weight"] is three.graph.constants["weight"]


def test_the_compiled_steps_compute_what_the_loop_over_them_computes():
    graph = toy_decoder(layers=3)
    rng = np.random.default_rng(0)
    inputs = {"ids": rng.integers(0, 50, 6).astype(np.int64), "positions": np.arange(6, dtype=np.int64)}
    plan = Plan.for_inputs(graph, CPU, inputs)
    assert plan.compiled is not None and plan.compiled.source.count("\n") > len(plan.steps)
    np.testing.assert_array_equal(plan.run(inputs)[0], plan._run_steps(inputs)[0])


def test_a_kernel_failing_in_the_compiled_steps_names_its_node():
    g = GraphBuilder()
    table, index = g.input("table", (4, 3), "f32"), g.input("index", (2,), "i64")
    graph = g.output(g.relu(g.take(table, index)))
    plan = Plan.for_inputs(graph, CPU, {"table": np.ones((4, 3), np.float32), "index": np.zeros(2, np.int64)})
    assert plan.compiled is not None
    node = next(n for n in plan.graph.nodes if n.op == "take")
    with pytest.raises(RequestError, match=f"node {node.name!r} \\(take\\)"):
        plan.run({"table": np.ones((4, 3), np.float32), "index": np.array([0, 9], np.int64)})


def test_a_loaded_model_has_run_its_prompt_and_decode_steps_and_holds_no_page_for_them(tmp_path):
    """Loading compiles (and captures) what a request runs, by running it: a prompt's step and decode
    steps; the sequence it used is let go, and nothing of it reaches the prefix cache."""
    from soma_runtime.tasks import Runtime
    from tests.fixtures.decoders import build_model
    build_model("llama", str(tmp_path))
    engine = Runtime("cpu").load(str(tmp_path), progress=False).engine
    rows = {plan.bindings["S"] for plan in engine.stages[0].program.plans.values()}
    assert {1, 40} <= rows
    assert engine.pool.in_use == 0 and not engine.pool.by_hash

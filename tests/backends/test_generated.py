"""Generated jets: random chains of elementwise ops, chained by the fuse pass and compiled from their
formula, against the atoms (numpy in f64) on the same inputs; and the chain pass's bounds."""
from __future__ import annotations

import json

import numpy as np
import pytest

from soma_runtime.backends import get
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.ir.passes.chains import MAX_STEPS
from soma_runtime.ir.program import Program

CPU, REFERENCE = get("cpu"), get("reference")
OUT = (3, 5, 7)
UNARY = ["relu", "sigmoid", "tanh", "silu", "neg", "abs", "exp", "sin", "cos", "erf", "floor", "round", "gelu",
         "leaky_relu"]
BINARY = ["add", "sub", "mul", "div", "maximum", "minimum"]
SAFE = {"exp": lambda g, x: g.tanh(x)}        # arguments kept where the function is finite


def broadcastable(rng) -> tuple:
    """A shape that broadcasts to OUT: each axis kept or 1, leading axes maybe dropped."""
    shape = tuple(d if rng.random() < 0.6 else 1 for d in OUT)
    return shape[rng.integers(0, len(shape) + 1):] if rng.random() < 0.3 else shape


def random_chain(seed: int):
    """A graph of 3-9 elementwise ops over 1-4 f32 inputs of broadcast shapes (one full, so the output is
    OUT) and maybe an i64 one cast to f32, with inputs for it: some strided views, some 0-d."""
    rng = np.random.default_rng(seed)
    dtype, np_dtype = "f32", np.float32
    g = GraphBuilder()
    shapes = [OUT] + [broadcastable(rng) for _ in range(rng.integers(0, 4))]
    values = [g.input(f"x{k}", s, dtype) for k, s in enumerate(shapes)]
    counts = seed % 3 == 0
    if counts:
        values.append(g.cast(g.input("n", broadcastable(rng), "i64"), dtype="f32"))
    for _ in range(rng.integers(3, 10)):
        if rng.random() < 0.45 and len(values) > 1:
            a, b = rng.choice(len(values), 2, replace=False)
            op = str(rng.choice(BINARY))
            right = g.add(g.abs(values[b]), g.const(f"one{len(values)}", np.array(1, np_dtype))) if op == "div" else values[b]
            values.append(getattr(g, op)(values[a], right))
        elif rng.random() < 0.15:
            x = values[rng.integers(len(values))]
            values.append(g.where(g.less(x, g.const(f"zero{len(values)}", np.zeros((), np_dtype))), x, g.mul(x, x)))
        else:
            op = str(rng.choice(UNARY))
            x = values[rng.integers(len(values))]
            x = SAFE[op](g, x) if op in SAFE else x
            values.append(getattr(g, op)(x))
    read = {t for n in g.graph.nodes for t in n.inputs}
    top = values[-1]
    for v in values[len(shapes):-1]:                      # every op made counts: the unread ones summed in
        if v.name not in read:
            top = g.add(top, v)
    if tuple(top.meta.shape) != OUT:
        top = g.add(top, values[0])
    inputs = {}
    if counts:
        inputs["n"] = rng.integers(-3, 4, g.graph.inputs["n"].shape).astype(np.int64)
    for k, s in enumerate(shapes):
        x = (rng.standard_normal(s) * 2).astype(np_dtype)
        if x.ndim >= 2 and rng.random() < 0.3:          # a strided view of the same values
            x = np.ascontiguousarray(x.swapaxes(-1, -2)).swapaxes(-1, -2)
        inputs[f"x{k}"] = x
    return g.output(top), inputs


@pytest.mark.parametrize("seed", range(24))
def test_a_random_elementwise_chain_compiled_from_its_formula_equals_its_atoms(seed):
    graph, inputs = random_chain(seed)
    want = Program(random_chain(seed)[0], REFERENCE).run({}, inputs)[0]
    program = Program(graph, CPU)
    plan = program.plan({})
    chains = [step for step in plan.steps if step.node.op == "chain"]
    assert chains and all(step.kernel.__qualname__.startswith("generate.") for step in chains)
    got = plan.run(inputs)[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=8e-5 * scale)


def test_what_another_node_reads_or_the_graph_returns_stays_outside_a_chain():
    g = GraphBuilder()
    x = g.input("x", (4, 8), "f32")
    shared = g.sigmoid(x)                                 # read by the chain and by the reduction
    inner = g.mul(g.tanh(shared), x)                      # a graph output: the root of a chain of its own
    graph = g.output(g.add(g.relu(inner), g.reduce_sum(shared, axes=(-1,), keepdims=True)), inner)
    program = Program(graph, CPU)
    ops = [n.op for n in program.graph.nodes]
    assert program.fusions["chain"] == 2 and ops.count("sigmoid") == 1 and "reduce_sum" in ops
    x_value = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    got = program.run({}, {"x": x_value})
    s = 1 / (1 + np.exp(-x_value.astype(np.float64)))
    inner_want = np.tanh(s) * x_value
    np.testing.assert_allclose(got[1], inner_want, atol=1e-6)
    np.testing.assert_allclose(got[0], np.maximum(inner_want, 0) + s.sum(-1, keepdims=True), atol=1e-5)


def test_a_run_longer_than_a_chain_may_be_becomes_several_chains():
    """An unrolled loop's thousands of adds would take minutes to compile as one loop: at most MAX_STEPS
    steps a chain."""
    g = GraphBuilder()
    y = x = g.input("x", (3,), "f32")
    for _ in range(3 * MAX_STEPS + 5):
        y = g.add(y, x)
    program = Program(g.output(y), CPU)
    assert all(len(json.loads(n.attrs["steps"])) <= MAX_STEPS for n in program.graph.nodes)
    assert program.fusions["chain"] == 4 and len(program.graph.nodes) == 4
    x_value = np.array([1.0, -2.0, 0.5], np.float32)
    np.testing.assert_allclose(program.run({}, {"x": x_value})[0], x_value * (3 * MAX_STEPS + 6), rtol=1e-6)


def test_a_backend_that_compiles_no_formula_gets_no_chain():
    graph, _ = random_chain(0)
    assert "chain" not in Program(graph, REFERENCE).fusions


def test_under_soma_verify_a_generated_jet_runs_beside_its_atoms_and_a_wrong_one_is_caught(monkeypatch):
    from soma_runtime.errors import JetMismatchError
    monkeypatch.setenv("SOMA_VERIFY", "1")
    graph, inputs = random_chain(3)
    Program(graph, CPU).run({}, inputs)                    # the generated jet agrees
    compiled = type(CPU).generated

    def off_by_a_bit(self, atoms, dtypes, out_dtype):
        kernel = compiled(self, atoms, dtypes, out_dtype)
        return lambda *xs, out=None, **attrs: kernel(*xs, out=out) + np.float32(1e-2)
    monkeypatch.setattr(type(CPU), "generated", off_by_a_bit)
    graph, inputs = random_chain(1000)                     # a chain no kernel was chosen for yet
    with pytest.raises(JetMismatchError, match="chain"):
        Program(graph, CPU).run({}, inputs)

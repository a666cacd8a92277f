"""Graph construction and validation: bad graphs raise GraphError naming the node."""
from __future__ import annotations

import numpy as np
import pytest

from soma_runtime.errors import GraphError
from soma_runtime.ir.builder import GraphBuilder, validate
from soma_runtime.ir.graph import Graph, Node, Sym, TensorMeta


def test_builder_infers_symbolic_shapes():
    g = GraphBuilder()
    x = g.input("x", ("B", "S", 64), "f32")
    w = g.const("w", np.zeros((128, 64), np.float32))
    y = g.reshape(g.matmul(x, w, transpose_b=True), shape=("B", "S", 2, -1))
    assert y.shape == (Sym("B"), Sym("S"), 2, 64)
    parts = g.split(y, sizes=(40, 24), axis=-1)
    assert [p.shape[-1] for p in parts] == [40, 24]
    assert g.concat(*parts, axis=-1).shape[-1] == 64



def test_a_reshapes_minus_one_cancels_symbolic_factors_with_coefficients():
    """torch's dynamo export of ViT: [(B*12), 197, 64] -> [-1, 12, 197, 64] is B (the 12 cancels the 12)."""
    g = GraphBuilder()
    x = g.reshape(g.input("x", ("B", 12, 197, 64), "f32"), shape=(-1, 197, 64))
    assert x.shape == (Sym("B") * 12, 197, 64)
    assert g.reshape(x, shape=(-1, 12, 197, 64)).shape == (Sym("B"), 12, 197, 64)
    assert g.reshape(x, shape=(-1, 4, 197, 64)).shape == (Sym("B") * 3, 4, 197, 64)

def test_cycle_raises_naming_a_node():
    g = Graph(inputs={"x": TensorMeta.of((4,), "f32")}, outputs=["b"])
    g.nodes = [Node("add", ["x", "b"], ["a"], name="first"), Node("relu", ["a"], ["b"], name="second")]
    with pytest.raises(GraphError, match="'(first|second)'.*cycle"):
        validate(g)


def test_unknown_op_raises_naming_the_node():
    g = Graph(inputs={"x": TensorMeta.of((4,), "f32")}, outputs=["y"])
    g.nodes = [Node("frobnicate", ["x"], ["y"], name="mystery")]
    with pytest.raises(GraphError, match="'mystery'.*unknown op 'frobnicate'"):
        validate(g)


def test_dangling_input_raises_naming_the_node():
    g = Graph(inputs={"x": TensorMeta.of((4,), "f32")}, outputs=["y"])
    g.nodes = [Node("add", ["x", "ghost"], ["y"], name="adder")]
    with pytest.raises(GraphError, match="'adder'.*'ghost'"):
        validate(g)


def test_shape_mismatch_raises_naming_the_node():
    g = GraphBuilder()
    x = g.input("x", (3, 8), "f32")
    w = g.const("w", np.zeros((5, 7), np.float32))
    with pytest.raises(GraphError, match="'proj' \\(matmul\\): inner dims differ: 8 vs 7"):
        g.matmul(x, w, transpose_b=True, name="proj")


def test_dtype_mismatch_and_bad_attrs_raise():
    g = GraphBuilder()
    a, b = g.input("a", (4,), "f32"), g.input("b", (4,), "f16")
    with pytest.raises(GraphError, match="dtype mismatch"):
        g.add(a, b)
    with pytest.raises(GraphError, match="unknown attribute"):
        g.relu(a, slope=2)
    with pytest.raises(GraphError, match="do not broadcast"):
        g.mul(a, g.input("c", (3,), "f32"))
    with pytest.raises(GraphError, match="cannot reshape"):
        g.reshape(a, shape=(3, -1))


def test_graph_output_must_exist():
    g = Graph(inputs={"x": TensorMeta.of((4,), "f32")}, outputs=["nowhere"])
    with pytest.raises(GraphError, match="'nowhere'"):
        validate(g)

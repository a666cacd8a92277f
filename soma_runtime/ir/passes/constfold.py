"""Constant folding: a pure node whose inputs are all constants is computed once, at plan time."""
from __future__ import annotations

from soma_runtime.errors import GraphError
from soma_runtime.ir.graph import Graph
from soma_runtime.ir.ops import OPS


def fold_constants(graph: Graph, run_node) -> int:
    """`run_node(node, inputs)` computes a node (GraphError: not now, a size it needs is still free);
    folded outputs become constants. Returns the count."""
    kept, folded = [], 0
    for node in graph.nodes:
        inputs = node.inputs
        if OPS[node.op].stateful or not all(i is None or i in graph.constants for i in inputs):
            kept.append(node)
            continue
        try:
            values = run_node(node, [None if i is None else graph.constants[i] for i in inputs])
        except GraphError:
            kept.append(node)
            continue
        values = values if isinstance(values, tuple) else (values,)
        for name, value in zip(node.outputs, values):
            graph.constants[name] = value
        folded += 1
    graph.nodes = kept
    return folded

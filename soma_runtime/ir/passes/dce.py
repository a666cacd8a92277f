"""Dead-node elimination: keep what the outputs need, plus stateful nodes (a KV write matters
even when nothing reads its result in this graph)."""
from __future__ import annotations

from soma_runtime.ir.graph import Graph
from soma_runtime.ir.ops import OPS


def eliminate_dead_nodes(graph: Graph) -> int:
    """Remove unreachable nodes and unused constants in place; returns how many nodes went."""
    producer = graph.producers()
    live: set[str] = set()
    stack = list(graph.outputs) + [o for n in graph.nodes if OPS[n.op].stateful for o in n.outputs]
    while stack:
        t = stack.pop()
        if t in live:
            continue
        live.add(t)
        if t in producer:
            stack.extend(i for i in producer[t].inputs if i is not None)
    before = len(graph.nodes)
    graph.nodes = [n for n in graph.nodes if any(o in live for o in n.outputs)]
    graph.constants = {k: v for k, v in graph.constants.items() if k in live}
    return before - len(graph.nodes)

"""Dead-node elimination: keep what the outputs need, plus stateful nodes (a KV write matters
even when nothing reads its result in this graph), and the nodes that decide a size only the data
gives which a kept node's attributes name (a reshape to a range's length)."""
from __future__ import annotations

from soma_runtime.ir.graph import Graph, Sym, dynamic_dim, names_in
from soma_runtime.ir.ops import OPS


def eliminate_dead_nodes(graph: Graph) -> int:
    """Remove unreachable nodes and unused constants in place; returns how many nodes went."""
    producer = graph.producers()
    deciders = {dynamic_dim(n.name, k).expr: o for n in graph.nodes if OPS[n.op].count for k, o in enumerate(n.outputs)}
    live: set[str] = set()
    stack = list(graph.outputs) + [o for n in graph.nodes if OPS[n.op].stateful for o in n.outputs]
    while stack:
        t = stack.pop()
        if t in live:
            continue
        live.add(t)
        if t in producer:
            stack.extend(i for i in producer[t].inputs if i is not None)
            stack.extend(deciders[name] for name in size_names(producer[t].attrs) if name in deciders)
    before = len(graph.nodes)
    graph.nodes = [n for n in graph.nodes if any(o in live for o in n.outputs)]
    graph.constants = {k: v for k, v in graph.constants.items() if k in live}
    return before - len(graph.nodes)


def size_names(attrs: dict) -> set[str]:
    """The named sizes inside a node's attributes (nested in tuples, as a pad's pairs are)."""
    names, pending = set(), list(attrs.values())
    while pending:
        value = pending.pop()
        if isinstance(value, (tuple, list)):
            pending.extend(value)
        elif isinstance(value, Sym):
            names |= names_in(value)
    return names

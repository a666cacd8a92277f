"""Chains: runs of elementwise ops that the fuse rules left as they were become one `chain` node.

A chain grows from a root (an elementwise op) up through the producers of its inputs while each is
elementwise too, computes a tensor of the root's shape and is read by nothing outside the chain: `x * sigmoid(1.702
* x)`, a hardswish written out, the affine tail of a norm after its reductions. Elementwise means the
op's decomposition holds only elementwise atoms (arithmetic, comparisons, selections, unary functions,
casts between floats) and it makes f32: a backend that compiles formulas runs the chain as one loop
over its output, each value read once and written once. Chains of one op are left alone; a run longer
than MAX_STEPS becomes several chains (a compiled loop's code grows with its steps: an unrolled loop's
thousands of adds would take minutes to compile as one).
Knows ops, atoms and graphs; nothing of backends or kernels.
"""
from __future__ import annotations

from soma_runtime.ir.graph import Graph, Node
from soma_runtime.ir.ops import OPS
from soma_runtime.ir.ops.chain import written

POINTWISE_ATOMS = {"input", "literal", "param", "mul", "add", "cmp", "exp"}
FLOAT_CASTS = {("f32",), ("f64",)}
MAX_STEPS = 32


def pointwise(node: Node, graph: Graph) -> bool:
    """Whether the node computes each f32 output value from the inputs' values at that place alone."""
    if node.op == "chain" or len(node.outputs) != 1 or graph.tensors[node.outputs[0]].dtype != "f32":
        return False
    opdef = OPS[node.op]
    if opdef.stateful or opdef.view or opdef.any_rank or opdef.count is not None or None in node.inputs or \
            not all(v is None or type(v) in (bool, int, float, str) for v in node.attrs.values()):
        return False                       # (attrs as the chain's JSON keeps them)
    try:
        atoms = opdef.decomposition([graph.tensors[t] for t in node.inputs], node.attrs).nodes
    except Exception:                      # noqa: BLE001  (an op that cannot be traced here is not chained)
        return False
    return all(a.atom in POINTWISE_ATOMS or a.atom == "read" and a.mode == "cast" and a.struct in FLOAT_CASTS
               for a in atoms) and all(not isinstance(a.mode, (tuple, list)) for a in atoms if a.atom == "param")


def chain_pointwise(graph: Graph) -> int:
    """Rewrite `graph` in place (its tensors' metas current): every chain of two or more pointwise ops
    becomes one node; returns how many."""
    producer = graph.producers()
    readers: dict[str, list[Node]] = {}
    for n in graph.nodes:
        for t in set(n.inputs) - {None}:
            readers.setdefault(t, []).append(n)
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    eligible = {id(n) for n in graph.nodes if pointwise(n, graph)}
    taken: set[int] = set()
    chains: dict[int, Node] = {}
    for root in reversed(graph.nodes):                     # consumers first: a root takes all it can
        if id(root) not in eligible or id(root) in taken:
            continue
        shape = graph.tensors[root.outputs[0]].shape
        members, grew = {id(root): root}, True
        while grew:                                        # a producer joins once all its readers have
            grew = False
            for t in {t for n in members.values() for t in n.inputs} - {None}:
                p = producer.get(t)
                if len(members) < MAX_STEPS and p is not None and id(p) in eligible and id(p) not in taken \
                        and id(p) not in members and t not in graph.outputs and graph.tensors[t].shape == shape \
                        and all(id(r) in members for r in readers[t]):
                    members[id(p)] = p
                    grew = True
        if len(members) < 2:
            continue
        taken.update(members)
        chains[id(root)] = chained(sorted(members.values(), key=lambda n: order[id(n)]))
    graph.nodes = [chains.get(id(n), n) for n in graph.nodes if id(n) not in taken or id(n) in chains]
    return len(chains)


def chained(members: list[Node]) -> Node:
    """One chain node computing `members` (in graph order; the last is the root)."""
    inputs: list[str] = []
    made = {n.outputs[0]: k for k, n in enumerate(members)}
    index: dict[str, int] = {}
    for n in members:
        for t in n.inputs:
            if t not in made and t not in index:
                index[t] = len(inputs)
                inputs.append(t)
    steps = [(n.op, [index[t] if t in index else len(inputs) + made[t] for t in n.inputs], n.attrs) for n in members]
    root = members[-1]
    return Node("chain", inputs, list(root.outputs), {"steps": written(steps)}, root.name)

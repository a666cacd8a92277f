"""Recognition: a subgraph of primitive ops whose formula is a fused op's becomes that op.

Every tensor of the graph gets its exact term (formula.py: the atoms of what computes it, algebra
normalized, reshapes transparent), graph inputs and weights as named leaves and scalar constants as
literals. Each fused op below is a pattern: its own decomposition, inputs as slots, its epsilon or
scale as named params. Where a pattern matches the term of a node's output, the op is instantiated on
the tensors the slots found, with the params' values, and replaces the node only when its terms then
key exactly as the node's do: the same formula, however the exporter spelled it. What differs (an
epsilon added after the square root) keys differently and is left alone.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cache

import numpy as np

from soma_runtime.errors import GraphError
from soma_runtime.ir.formula import Binding, Canon, Marker, Term, leaf, literal, match, node
from soma_runtime.ir.graph import Graph, Node, Sym, TensorMeta, same_dim
from soma_runtime.ir.ops import OPS

EXACT = Canon(exact=True)
TRACE_ERRORS = (GraphError, ArithmeticError, LookupError, TypeError, ValueError)   # a decomposition that needs sizes it lacks


@dataclass(frozen=True)
class Target:
    """A fused op as a pattern: which of its inputs are present, its struct attrs, its named params."""
    op: str
    present: tuple[bool, ...]
    attrs: tuple = ()
    params: tuple[str, ...] = ()
    ranks: tuple[int, ...] = (2, 1, 1)       # each input's rank as the pattern is traced

    @property
    def name(self) -> str:
        return f"recognized {self.op}"


TARGETS = [   # most inputs first: a layernorm with its bias is not taken for one without
    Target("sdpa", (True, True, True, True), params=("scale",), ranks=(4, 4, 4, 4)),
    Target("sdpa", (True, True, True, False), params=("scale",), ranks=(4, 4, 4, 4)),
    Target("layernorm", (True, True, True), params=("eps",)),
    Target("layernorm", (True, True, False), params=("eps",)),
    Target("layernorm", (True, False, False), params=("eps",)),
    Target("rmsnorm", (True, True), params=("eps",)),
    Target("rmsnorm", (True, False), params=("eps",)),
    Target("gelu", (True,), (("approximate", "none"),)),
    Target("gelu", (True,), (("approximate", "tanh"),)),
    Target("softmax", (True, False), ranks=(2, 2)),
    Target("silu", (True,)),
]


@cache
def pattern(target: Target) -> Term:
    opdef = OPS[target.op]
    metas = [TensorMeta(tuple(Sym(f"d{i}_{j}") for j in range(rank)), "f32") if here else None
             for i, (here, rank) in enumerate(zip(target.present, target.ranks))]
    attrs = {**dict(target.attrs), **{p: Marker(p) for p in target.params}}
    A = opdef.decomposition(metas, attrs)
    return EXACT.terms(A)[A.outputs[0]]


class Lowering:
    """Each tensor's exact term, computed once, and the tensor each term is."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.producer = {o: n for n in graph.nodes for o in n.outputs}
        self.terms: dict[str, Term] = {}
        self.tensor_of: dict[bytes, list[str]] = {}        # reshapes are transparent: one term, several tensors

    def term(self, tensor: str) -> Term:
        stack = [tensor]
        while stack:                                   # producers first, without recursion (deep graphs)
            t = stack[-1]
            if t in self.terms:
                stack.pop()
                continue
            n = self.producer.get(t)
            waiting = [i for i in (n.inputs if n else ()) if i is not None and i not in self.terms]
            if waiting:
                stack.extend(waiting)
                continue
            stack.pop()
            if n is None:
                self.keep(t, self.leaf(t))
            else:
                for out, term in zip(n.outputs, self.lower(n)):
                    self.keep(out, term)
        return self.terms[tensor]

    def keep(self, tensor: str, term: Term) -> None:
        self.terms[tensor] = term
        self.tensor_of.setdefault(term.key, []).append(tensor)

    def leaf(self, tensor: str) -> Term:
        value = self.graph.constants.get(tensor)
        if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind == "f":
            return literal(float(value.reshape(-1)[0]))            # a scalar weight is the number it holds
        return leaf("tensor", tensor)

    def lower(self, n: Node) -> list[Term]:
        metas = [None if i is None else self.graph.tensors[i] for i in n.inputs]
        leaves = [None if i is None else self.terms[i] for i in n.inputs]
        if OPS[n.op].canonical is not None:            # a loop as long as a limit: traced, it would be that long
            return [leaf("tensor", o) for o in n.outputs]
        if n.op == "reshape" and not keeps_rows(metas[0], self.graph.tensors[n.outputs[0]]):
            last = self.graph.tensors[n.outputs[0]].shape[-1:]
            return [node("read", "regroup", (leaves[0],), (("last", repr(last)),))]
        try:
            A = OPS[n.op].decomposition(metas, n.attrs)
            terms = EXACT.terms(A, leaves)
            return [terms[o] for o in A.outputs]
        except TRACE_ERRORS:                            # a formula we cannot trace is a name of its own
            return [leaf("tensor", o) for o in n.outputs]

    def named(self, term: Term, rank: int) -> str | None:
        """A tensor whose term this is, of the rank wanted where several are (a reshape of it)."""
        names = self.tensor_of.get(term.key, [])
        return next((t for t in names if self.graph.tensors[t].ndim == rank), names[0] if names else None)

    def tensor(self, term: Term, rank: int) -> tuple[str, Node | None] | None:
        """The tensor a bound term is, or a transpose of one to add (attention's keys come either way)."""
        if term.key in self.tensor_of:
            return self.named(term, rank), None
        if term.kind == "read" and term.mode == "transpose" and term.args[0].key in self.tensor_of:
            source = self.named(term.args[0], rank)
            axes = eval(dict(term.attrs)["axes"])
            name = f"{source}:transposed"
            made = None if name in self.producer else Node("transpose", [source], [name], {"dim0": axes[0], "dim1": axes[1]},
                                                           name)
            return name, made
        return None


def keeps_rows(source: TensorMeta, target: TensorMeta) -> bool:
    """A reshape that keeps the last axis whole (it only merges or splits the ones before) is transparent
    to the row-wise formulas recognized here; one that regroups the rows is not (a group norm's reshape
    makes a layernorm's formula over other rows than x's own)."""
    return source.ndim > 0 and target.ndim > 0 and same_dim(source.shape[-1], target.shape[-1]) is True


def instantiate(low: Lowering, target: Target, found: Binding, root: str) -> tuple[Node, list[Node]] | None:
    """The fused node for a match, with the transposes it needs, if its terms key as the root's do."""
    inputs, extra = [], []
    for slot, here in enumerate(target.present):
        if not here:
            inputs.append(None)
            continue
        bound = low.tensor(found.inputs[slot], target.ranks[slot])
        if bound is None:
            return None
        name, transpose = bound
        if transpose is not None:
            meta = low.graph.tensors[transpose.inputs[0]]
            shape = list(meta.shape)
            a, b = transpose.attrs["dim0"], transpose.attrs["dim1"]
            shape[a], shape[b] = shape[b], shape[a]
            low.graph.tensors[name] = TensorMeta(tuple(shape), meta.dtype)
            extra.append(transpose)
        inputs.append(name)
    attrs = {**dict(target.attrs), **{p: found.params[p] for p in target.params}}
    metas = [None if i is None else low.graph.tensors[i] for i in inputs]
    try:
        OPS[target.op].infer(metas, attrs, root)
        A = OPS[target.op].decomposition(metas, attrs)
    except TRACE_ERRORS:
        return None
    leaves = [found.inputs[slot] if here else None for slot, here in enumerate(target.present)]
    if EXACT.terms(A, leaves)[A.outputs[0]].key != low.terms[root].key:
        return None
    return Node(target.op, inputs, [root], attrs, f"{root}:{target.op}"), extra


def recognize(graph: Graph) -> Counter:
    """Rewrite every subgraph that is a fused op's formula to that op, in place, the outermost first
    (a layernorm's bias add, not the normalization inside it); returns {what: count}."""
    report = Counter()
    low = Lowering(graph)
    fused = {t.op for t in TARGETS}
    live = live_tensors(graph)
    for n in reversed(list(graph.nodes)):
        if n.op in fused or len(n.outputs) != 1 or OPS[n.op].stateful or n.outputs[0] not in live:
            continue
        root = n.outputs[0]
        term = low.term(root)
        for target in TARGETS:
            p = pattern(target)
            if p.kind != term.kind or (p.kind not in ("sum", "product") and p.mode != term.mode):
                continue
            made = next((m for found in match(p, term, Binding()) if (m := instantiate(low, target, found, root))), None)
            if made is not None:
                fused_node, extra = made
                at = next(i for i, x in enumerate(graph.nodes) if x is n)
                graph.nodes[at:at + 1] = [*extra, fused_node]
                for t in extra:
                    low.producer[t.outputs[0]] = t
                low.producer[root] = fused_node
                report[target.name] += 1
                live = live_tensors(graph)
                break
    return report


def live_tensors(graph: Graph) -> set[str]:
    """What the outputs (and stateful nodes) still read."""
    producer = {o: n for n in graph.nodes for o in n.outputs}
    stack = list(graph.outputs) + [o for n in graph.nodes if OPS[n.op].stateful for o in n.outputs]
    live: set[str] = set()
    while stack:
        t = stack.pop()
        if t not in live:
            live.add(t)
            if t in producer:
                stack.extend(i for i in producer[t].inputs if i is not None)
    return live

"""The graph IR: typed tensors (`TensorMeta`), op nodes (`Node`), the DAG (`Graph`) and its builder.

A dim is an int or a `Sym` (a named size such as `B`, `S`, or an expression like `T+S`),
bound to ints when a Plan is made. The graph knows op names and shape rules (from ops.py),
nothing about backends or models.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.dtypes import QTensor, dtype_of
from soma_runtime.errors import GraphError


class Sym:
    """A symbolic size: an arithmetic expression over named dims, resolved by `resolve`."""

    __slots__ = ("expr",)

    def __init__(self, expr: str):
        self.expr = expr

    def _op(self, other, sym, flip=False):
        a, b = (other, self) if flip else (self, other)
        return Sym(f"({a}{sym}{b})")

    def __add__(self, o): return self._op(o, "+")
    def __radd__(self, o): return self._op(o, "+", True)
    def __sub__(self, o): return self._op(o, "-")
    def __rsub__(self, o): return self._op(o, "-", True)
    def __mul__(self, o): return self._op(o, "*")
    def __rmul__(self, o): return self._op(o, "*", True)
    def __floordiv__(self, o): return self._op(o, "//")
    def __rfloordiv__(self, o): return self._op(o, "//", True)
    def __mod__(self, o): return self._op(o, "%")
    def __neg__(self): return Sym(f"(-{self})")
    def __str__(self): return self.expr
    __repr__ = __str__
    def __eq__(self, o): return isinstance(o, Sym) and o.expr == self.expr
    def __hash__(self): return hash(self.expr)


Dim = int | Sym
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def dim(d) -> Dim:
    if isinstance(d, (int, np.integer)):
        return int(d)
    if isinstance(d, Sym):
        return d
    if isinstance(d, str):
        return Sym(d)
    raise GraphError(f"a dim must be an int or a symbol name, got {d!r}")


def resolve(d: Dim, bindings: dict[str, int]) -> int:
    if isinstance(d, int):
        return d
    names = set(_NAME.findall(d.expr))
    missing = names - bindings.keys()
    if missing:
        raise GraphError(f"dim {d} needs a value for {', '.join(sorted(missing))}")
    return int(eval(d.expr, {"__builtins__": {}}, dict(bindings)))


def same_dim(a: Dim, b: Dim) -> bool | None:
    """True/False when known, None when symbolic dims can't be compared until bound."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return True if a == b else None


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[Dim, ...]
    dtype: str
    residency: str = "resident"   # resident | cached | streamed

    @staticmethod
    def of(shape, dtype: str, residency="resident") -> TensorMeta:
        return TensorMeta(tuple(dim(d) for d in shape), dtype, residency)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def bind(self, bindings: dict[str, int], free: frozenset[str] = frozenset()) -> TensorMeta:
        """Concrete dims from the bindings; dims over a `free` name stay symbolic."""
        shape = tuple(d if isinstance(d, Sym) and free & set(_NAME.findall(d.expr)) else resolve(d, bindings)
                      for d in self.shape)
        return TensorMeta(shape, self.dtype, self.residency)


def meta_of(value) -> TensorMeta:
    if isinstance(value, QTensor):
        return TensorMeta(value.shape, value.dtype.name)
    value = np.asarray(value)
    return TensorMeta(tuple(int(s) for s in value.shape), dtype_of(value))


@dataclass
class Node:
    op: str
    inputs: list[str | None]      # tensor names; None for an absent optional input
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    name: str = ""
    backend_hint: str | None = None


@dataclass
class Graph:
    """Nodes in topological order; named inputs, constants (weights) and outputs."""

    inputs: dict[str, TensorMeta] = field(default_factory=dict)
    constants: dict[str, object] = field(default_factory=dict)    # ndarray or QTensor
    nodes: list[Node] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    tensors: dict[str, TensorMeta] = field(default_factory=dict)

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def toposort(self) -> None:
        """Order nodes so each comes after its producers; a cycle raises GraphError naming a node."""
        producer = self.producers()
        state: dict[str, int] = {}
        order: list[Node] = []

        def visit(node: Node):
            mark = state.get(node.name, 0)
            if mark == 2:
                return
            if mark == 1:
                raise GraphError(f"node {node.name!r} ({node.op}) is part of a cycle")
            state[node.name] = 1
            for t in node.inputs:
                if t is not None and t in producer:
                    visit(producer[t])
            state[node.name] = 2
            order.append(node)

        for n in self.nodes:
            visit(n)
        self.nodes = order

    def validate(self) -> None:
        """Check ops exist, inputs are defined, and every node's shapes/dtypes agree with its op."""
        from soma_runtime.ir.ops import OPS
        self.toposort()
        known = dict(self.inputs)
        known.update({k: meta_of(v) for k, v in self.constants.items()})
        for n in self.nodes:
            if n.op not in OPS:
                raise GraphError(f"node {n.name!r}: unknown op {n.op!r}")
            metas = []
            for t in n.inputs:
                if t is not None and t not in known:
                    raise GraphError(f"node {n.name!r} ({n.op}): input {t!r} is not produced by any node")
                metas.append(None if t is None else known[t])
            out = OPS[n.op].infer(metas, n.attrs, n.name)
            for name, meta in zip(n.outputs, out):
                known[name] = meta
        for o in self.outputs:
            if o not in known:
                raise GraphError(f"graph output {o!r} is not produced by any node")
        self.tensors = known


class Value:
    """A tensor handle returned by the builder; `g.rmsnorm(x, w, eps=1e-6)` reads like the model."""

    __slots__ = ("builder", "meta", "name")

    def __init__(self, builder: GraphBuilder, name: str, meta: TensorMeta):
        self.builder, self.name, self.meta = builder, name, meta

    @property
    def shape(self):
        return self.meta.shape

    @property
    def dtype(self):
        return self.meta.dtype

    def __repr__(self):
        return f"Value({self.name}, {list(self.shape)}, {self.dtype})"


class GraphBuilder:
    """Builds a Graph node by node, inferring and checking shapes as it goes."""

    def __init__(self):
        self.graph = Graph()
        self._count: dict[str, int] = {}

    def _fresh(self, base: str) -> str:
        k = self._count.get(base, 0)
        self._count[base] = k + 1
        return f"{base}_{k}" if k else base

    def input(self, name: str, shape, dtype: str) -> Value:
        meta = TensorMeta.of(shape, dtype)
        self.graph.inputs[name] = meta
        self.graph.tensors[name] = meta
        return Value(self, name, meta)

    def const(self, name: str, value) -> Value:
        name = self._fresh(name)
        self.graph.constants[name] = value
        meta = meta_of(value)
        self.graph.tensors[name] = meta
        return Value(self, name, meta)

    def op(self, op: str, *inputs: Value | None, name: str | None = None, **attrs):
        from soma_runtime.ir.ops import OPS
        if op not in OPS:
            raise GraphError(f"unknown op {op!r}")
        node_name = self._fresh(name or op)
        inputs = OPS[op].pad(inputs)
        metas = [None if v is None else v.meta for v in inputs]
        out_metas = OPS[op].infer(metas, attrs, node_name)
        outs = [node_name if len(out_metas) == 1 else f"{node_name}:{i}" for i in range(len(out_metas))]
        self.graph.nodes.append(Node(op, [None if v is None else v.name for v in inputs], outs, dict(attrs), node_name))
        values = [Value(self, o, m) for o, m in zip(outs, out_metas)]
        for v in values:
            self.graph.tensors[v.name] = v.meta
        return values[0] if len(values) == 1 else tuple(values)

    def __getattr__(self, op: str):
        from soma_runtime.ir.ops import OPS
        if op in OPS:
            return lambda *inputs, **attrs: self.op(op, *inputs, **attrs)
        raise AttributeError(op)

    def output(self, *values: Value) -> Graph:
        self.graph.outputs = [v.name for v in values]
        self.graph.validate()
        return self.graph

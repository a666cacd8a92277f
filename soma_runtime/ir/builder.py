"""Building graphs: `GraphBuilder` (`g.rmsnorm(x, w, eps=1e-6)` reads like the model, each node's
shapes inferred and checked as it is added) and `validate`, the check of a whole graph against the op set."""
from __future__ import annotations

from soma_runtime.errors import GraphError
from soma_runtime.ir.graph import Graph, Node, TensorMeta, meta_of
from soma_runtime.ir.ops import OPS


def validate(graph: Graph) -> None:
    """Check ops exist, inputs are defined, and every node's shapes/dtypes agree with its op."""
    graph.toposort()
    known = dict(graph.inputs)
    known.update({k: meta_of(v) for k, v in graph.constants.items()})
    for n in graph.nodes:
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
    for o in graph.outputs:
        if o not in known:
            raise GraphError(f"graph output {o!r} is not produced by any node")
    graph.tensors = known


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
        """`base`, or `base_k` for the first k whose name no tensor has (an imported graph's own names may
        already end in _k)."""
        k = self._count.get(base, 0)
        name = f"{base}_{k}" if k else base
        while name in self.graph.tensors:
            k += 1
            name = f"{base}_{k}"
        self._count[base] = k + 1
        return name

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
        if op in OPS:
            return lambda *inputs, **attrs: self.op(op, *inputs, **attrs)
        raise AttributeError(op)

    def output(self, *values: Value) -> Graph:
        self.graph.outputs = [v.name for v in values]
        validate(self.graph)
        return self.graph

"""The graph IR: typed tensors (`TensorMeta`), op nodes (`Node`) and the DAG (`Graph`), as plain data;
a `GraphFamily` is a graph built per value of some inputs.

A dim is an int or a `Sym` (a named size such as `B`, `S`, or an expression like `T+S`),
bound to ints when a Plan is made. The graph knows op names, nothing about what they compute
(ops/), how they are built (builder.py), backends or models.
"""
from __future__ import annotations

import re
from collections.abc import Callable
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
        if isinstance(other, (int, np.integer)) and sym in "+-" and not (flip and sym == "-"):
            return self.offset(int(other) if sym == "+" else -int(other))
        if isinstance(other, (int, np.integer)) and other == 1 and sym in ("*", "//") and not (flip and sym == "//"):
            return self                        # x * 1: the expression stays short
        a, b = (other, self) if flip else (self, other)
        return Sym(f"({a}{sym}{b})")

    def offset(self, k: int) -> Sym:
        """self + k, constants gathered into one: ((n + 6) - 6) - 1 is (n-1)."""
        base, known = self.expr, 0
        match = _OFFSET.match(self.expr)
        if match:
            base, known = match[1], int(match[3]) * (1 if match[2] == "+" else -1)
        total = known + k
        return Sym(base) if total == 0 else Sym(f"({base}{'+' if total > 0 else '-'}{abs(total)})")

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
_OFFSET = re.compile(r"^\((.*)([+-])(\d+)\)$")        # (expression + constant), as _op writes it
FUNCTIONS = {"min": min, "max": max}       # what a size's expression may call (dim_min, dim_max)
DYNAMIC = Sym("dynamic")       # what a shape rule says of a size only the data decides (a range's length)


def dim_min(a: Dim, b: Dim) -> Dim:
    """The smaller of two sizes: a number where both are, else a symbolic min (a slice's end past a length the
    data decides, a detector's limit on its boxes)."""
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return min(int(a), int(b))
    return a if a == b else Sym(f"min({a},{b})")


def dim_max(a: Dim, b: Dim) -> Dim:
    """The larger of two sizes (as dim_min)."""
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return max(int(a), int(b))
    return a if a == b else Sym(f"max({a},{b})")


def dynamic_dim(node: str, output: int) -> Sym:
    """The size a node's data decides, named after the node: known once the node has run."""
    return Sym(f"dyn_{re.sub(r'[^A-Za-z0-9_]', '_', node)}_{output}")


def is_dynamic(d: Dim) -> bool:
    return isinstance(d, Sym) and any(name.startswith("dyn_") for name in names_in(d))


def names_in(d: Sym) -> set[str]:
    """The named sizes a symbolic size is an expression of."""
    return set(_NAME.findall(d.expr)) - FUNCTIONS.keys()


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
    missing = names_in(d) - bindings.keys()
    if missing:
        raise GraphError(f"dim {d} needs a value for {', '.join(sorted(missing))}")
    return int(eval(d.expr, {"__builtins__": {}, **FUNCTIONS}, dict(bindings)))


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
        shape = tuple(d if isinstance(d, Sym) and free & names_in(d) else resolve(d, bindings)
                      for d in self.shape)
        return TensorMeta(shape, self.dtype, self.residency)


def meta_of(value) -> TensorMeta:
    if isinstance(value, QTensor):
        return TensorMeta(value.shape, value.dtype.name)
    value = np.asarray(value)
    return TensorMeta(tuple(int(s) for s in value.shape), dtype_of(value))


@dataclass(eq=False)
class Node:
    """One op application. Nodes are told apart by identity (two may read alike)."""
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
        """Order nodes so each comes after its producers (depth first, without recursion: a deep model
        is a long chain); a cycle raises GraphError naming a node."""
        producer = self.producers()
        state: dict[int, int] = {}            # by node identity: 1 on the path, 2 placed
        order: list[Node] = []
        for root in self.nodes:
            stack = [(root, iter(root.inputs))]
            while stack:
                node, pending = stack[-1]
                state[id(node)] = state.get(id(node), 1)
                for t in pending:
                    before = producer.get(t) if t is not None else None
                    if before is None or state.get(id(before)) == 2:
                        continue
                    if state.get(id(before)) == 1:
                        raise GraphError(f"node {before.name!r} ({before.op}) is part of a cycle")
                    stack.append((before, iter(before.inputs)))
                    break
                else:
                    stack.pop()
                    if state[id(node)] != 2:
                        state[id(node)] = 2
                        order.append(node)
        self.nodes = order


@dataclass
class GraphFamily:
    """A graph that can only be built once its inputs' sizes, and the values of some small integer inputs
    (axes, a shape or a count passed as data), are known: `build(values, shapes)` gives the graph for
    them, those inputs folded in. `inputs` and `outputs` are the signature every member shares."""

    inputs: dict[str, TensorMeta]
    outputs: dict[str, TensorMeta]
    value_inputs: tuple[str, ...]
    build: Callable[[dict, dict], Graph]

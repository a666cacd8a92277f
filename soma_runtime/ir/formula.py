"""A formula's canonical form: one `Term` per atom node, keyed by a Merkle hash of what it computes.

A term's key hashes its atom, mode, struct attrs and literal with its inputs' keys, never a build
order or a name, and the algebra every exporter writes differently is normalized first: sums and
products are flattened with their constants folded and their parts sorted (`x*0.5*w` is `0.5*(w*x)`),
`a - b` is `a + (-1)*b`, `1/sqrt(v)` is `rsqrt(v)`, `x**2` is `x*x`, constant factors leave a sum
over an axis, and a transpose of a transpose is its input. Two ways to key a formula:

- `formula_hash` (the jet registry's): sizes and params (axes, eps, offsets) excluded, every view kept;
- `exact` keys (recognition's): reshapes transparent (they only rename sizes), constant factors moved
  out of views, the
  params that change a result (axes, offsets) and params' values kept, a param keyed as the literal
  it is, so a fused op instantiated with a graph's epsilon keys like the graph's own atoms.

`match` finds where a fused op's formula sits in a graph's terms: which term each input of the op
is, and the value of each named param (epsilon, scale).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

from soma_runtime.ir.atoms import AtomGraph

COMMUTATIVE = {("cmp", "max"), ("cmp", "min"), ("cmp", "eq")}
VIEWS = {"reshape"}                       # only renames sizes: transparent to exact keys
LINEAR_VIEWS = {"expand", "transpose", "broadcast"}   # move values without changing them: constant factors pass out
SIZES = {"shape", "n", "ndim"}            # params that are sizes: never keyed
UNARY = {"exp": math.exp, "log": math.log, "sqrt": math.sqrt, "rsqrt": lambda v: 1 / math.sqrt(v), "recip": lambda v: 1 / v,
         "sin": math.sin, "cos": math.cos, "tanh": math.tanh, "erf": math.erf, "floor": math.floor, "round": round}
POWERS = {1.0: (), 2.0: ("x", "x"), 3.0: ("x", "x", "x"), 0.5: ("sqrt",), -0.5: ("rsqrt",), -1.0: ("recip",)}
RTOL = 1e-6                               # literals this close are one value (an exporter's f32 rounding)


def axes(v) -> tuple:
    """An axis or several, as one sorted tuple (-1 and (-1,) are one reduction)."""
    return tuple(sorted(v)) if isinstance(v, (tuple, list)) else (v,)


def digest(*parts) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def number(v) -> str:
    """A literal as its key writes it: 7 significant digits, so f32 and f64 spellings agree."""
    return f"{float(v):.7g}"


@dataclass(frozen=True, eq=False)
class Term:
    """One canonical node. Sums hold their constant and products their coefficient in `value`."""
    kind: str            # "input" | "literal" | "param" | "sum" | "product" | an atom name
    mode: object         # input slot or tensor name, param marker, atom mode
    args: tuple = ()
    attrs: tuple = ()
    value: float = 0.0
    key: bytes = b""

    @property
    def is_literal(self) -> bool:
        return self.kind == "literal"


def literal(v) -> Term:
    return Term("literal", None, value=float(v), key=digest("literal", number(v)))


def leaf(kind: str, mode) -> Term:
    return Term(kind, mode, key=digest(kind, mode))


def node(kind: str, mode, args: tuple, attrs: tuple = ()) -> Term:
    return Term(kind, mode, tuple(args), tuple(attrs), key=digest(kind, mode, attrs, *[a.key for a in args]))


def scaled(t: Term) -> tuple[float, Term | None]:
    """t as (coefficient, the rest): 3*x*y -> (3, x*y); a literal -> (value, None)."""
    if t.is_literal:
        return t.value, None
    if t.kind == "product":
        return t.value, product(1.0, t.args)
    return 1.0, t


def product(coef: float, parts) -> Term:
    factors = []
    for p in parts:
        if p.is_literal:
            coef *= p.value
        elif p.kind == "product":
            coef *= p.value
            factors.extend(p.args)
        else:
            factors.append(p)
    if coef == 0 or not factors:
        return literal(coef)
    if coef == 1 and len(factors) == 1:
        return factors[0]
    factors.sort(key=lambda f: f.key)
    return Term("product", None, tuple(factors), value=coef, key=digest("product", number(coef), *[f.key for f in factors]))


def total(const: float, parts) -> Term:
    coefs: dict[bytes, float] = {}
    units: dict[bytes, Term] = {}
    for p in parts:
        for t in (p.args if p.kind == "sum" else (p,)):
            c, unit = scaled(t)
            if unit is None:
                const += c
            else:
                coefs[unit.key] = coefs.get(unit.key, 0.0) + c
                units[unit.key] = unit
        if p.kind == "sum":
            const += p.value
    terms = [product(c, (units[k],)) for k, c in coefs.items() if c != 0]
    if not terms:
        return literal(const)
    if const == 0 and len(terms) == 1:
        return terms[0]
    terms.sort(key=lambda t: t.key)
    return Term("sum", None, tuple(terms), value=const, key=digest("sum", number(const), *[t.key for t in terms]))


def unary(mode: str, a: Term) -> Term:
    if a.is_literal and mode in UNARY:
        try:
            return literal(UNARY[mode](a.value))
        except (ValueError, ZeroDivisionError, OverflowError):
            pass
    if mode == "recip":
        if a.kind == "exp" and a.mode in ("recip", "sqrt", "rsqrt"):
            inverse = {"recip": None, "sqrt": "rsqrt", "rsqrt": "sqrt"}[a.mode]
            return a.args[0] if inverse is None else node("exp", inverse, a.args)
        if a.kind == "product" and a.value != 1:
            return product(1 / a.value, (unary("recip", product(1.0, a.args)),))
    return node("exp", mode, (a,))


def power(x: Term, exponent: Term) -> Term:
    if exponent.is_literal and exponent.value in POWERS:
        form = POWERS[exponent.value]
        if not form:
            return x
        return product(1.0, (x,) * len(form)) if form[0] == "x" else unary(form[0], x)
    return node("exp", "pow", (x, exponent))


class Canon:
    """Builds the terms of atom graphs. `exact`: recognition's keys (see the module docstring)."""

    def __init__(self, exact: bool = False):
        self.exact = exact

    def terms(self, graph: AtomGraph, leaves: list[Term] | None = None) -> list[Term]:
        """Every node's term; `leaves` stand for the graph's inputs (default: input slot i)."""
        out: list[Term] = []
        for n in graph.nodes:
            a = [out[i] for i in n.args]
            if n.atom == "input":
                out.append(leaves[n.mode] if leaves is not None else leaf("input", n.mode))
            elif n.atom == "literal":
                out.append(literal(n.mode))
            elif n.atom == "param":
                out.append(self.param(n.mode))
            else:
                out.append(self.atom(n, a))
        return out

    def param(self, value) -> Term:
        if self.exact and isinstance(value, (int, float)) and not isinstance(value, bool):
            return literal(value)
        if isinstance(value, Marker):
            return leaf("param", value.name)
        return leaf("param", "" if not self.exact else repr(value))

    def params(self, n) -> tuple:
        if not self.exact:
            return ()
        return tuple((k, repr(axes(v) if k == "axis" else v)) for k, v in sorted(n.params.items()) if k not in SIZES)

    def atom(self, n, a: list[Term]) -> Term:
        if n.atom == "mul":
            return product(1.0, a)
        if n.atom == "add":
            return total(0.0, a if n.mode == "add" else (a[0], product(-1.0, a[1:])))
        if n.atom == "exp":
            return power(*a) if n.mode == "pow" else unary(n.mode, a[0])
        if n.atom == "cmp" and (n.atom, n.mode) in COMMUTATIVE:
            return node("cmp", n.mode, sorted(a, key=lambda t: t.key))
        if n.atom == "reduce" and n.mode in ("sum", "mean") and a[0].kind == "product" and a[0].value != 1:
            inner = node("reduce", n.mode, (product(1.0, a[0].args),), (*n.struct, *self.params(n)))
            return product(a[0].value, (inner,))        # constant factors leave a sum
        if n.atom == "read":
            return self.read(n, a)
        return node(n.atom, n.mode, a, (*n.struct, *self.params(n)))

    def read(self, n, a: list[Term]) -> Term:
        if not self.exact:
            return node("read", n.mode, a, n.struct)
        mode, params = n.mode, n.params
        if mode in VIEWS:
            return a[0]
        if mode in LINEAR_VIEWS | {"permute"} and a[0].kind == "product" and a[0].value != 1:
            inner = self.read(n, [product(1.0, a[0].args)])       # (c x) viewed is c (x viewed)
            return product(a[0].value, (inner,))
        if mode == "permute":                             # a permutation swapping two axes is a transpose
            moved = [i for i, p in enumerate(params["perm"]) if p != i]
            if len(moved) == 2:
                rank = len(params["perm"])
                mode, params = "transpose", {"axis1": moved[0] - rank, "axis2": moved[1] - rank}
        if mode == "transpose":
            axes = (("axes", repr(tuple(sorted((params["axis1"], params["axis2"]))))),)
            inner = a[0]
            if inner.kind == "read" and inner.mode == "transpose" and inner.attrs == axes:
                return inner.args[0]
            return node("read", "transpose", a, axes)
        return node("read", mode, a, (*n.struct, *self.params(n)))


def formula_hash(graph: AtomGraph) -> str:
    """The jet registry's key of an atom graph: its outputs' terms (sizes and params excluded)."""
    terms = Canon().terms(graph)
    return hashlib.sha256(b"".join(terms[o].key for o in graph.outputs)).hexdigest()


# --- matching --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Marker:
    """A named param of a fused op's formula (its epsilon, its scale), bound to a value by `match`."""
    name: str


class Binding:
    """What a match has found so far: a term per input slot, a value per param marker."""

    def __init__(self, inputs=None, params=None):
        self.inputs: dict[int, Term] = dict(inputs or {})
        self.params: dict[str, float] = dict(params or {})

    def copy(self) -> Binding:
        return Binding(self.inputs, self.params)

    def bind_input(self, slot: int, t: Term) -> Binding | None:
        if slot in self.inputs:
            return self if self.inputs[slot].key == t.key else None
        b = self.copy()
        b.inputs[slot] = t
        return b

    def bind_param(self, name: str, value: float) -> Binding | None:
        if name in self.params:
            return self if close(self.params[name], value) else None
        b = self.copy()
        b.params[name] = value
        return b


def close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= RTOL * max(abs(a), abs(b))


def match(p: Term, t: Term, b: Binding) -> Iterator[Binding]:
    """Every binding under which pattern term `p` (a fused op's, inputs as slots) equals target `t`."""
    if p.kind == "input":
        found = b.bind_input(p.mode, t)
        if found is not None:
            yield found
    elif p.kind == "param":
        if t.is_literal and (found := b.bind_param(p.mode, t.value)) is not None:
            yield found
    elif p.kind == "literal":
        if t.is_literal and close(p.value, t.value):
            yield b
    elif p.kind in ("sum", "product"):
        if t.kind == p.kind:
            yield from match_parts(p, t, b)
    elif t.kind == p.kind and t.mode == p.mode and t.attrs == p.attrs and len(t.args) == len(p.args):
        orders = [t.args, t.args[::-1]] if (p.kind, p.mode) in COMMUTATIVE else [t.args]
        for args in orders:
            yield from match_all(list(p.args), list(args), b)


def match_all(ps: list[Term], ts: list[Term], b: Binding) -> Iterator[Binding]:
    if not ps:
        yield b
        return
    for found in match(ps[0], ts[0], b):
        yield from match_all(ps[1:], ts[1:], found)


def match_parts(p: Term, t: Term, b: Binding) -> Iterator[Binding]:
    """A flattened sum or product: a param part absorbs the target's constant, parts that are inputs
    absorb what the others leave (one input may take several: x*y where the pattern says x)."""
    params = [a for a in p.args if a.kind == "param"]
    slots = [a for a in p.args if a.kind == "input"]
    fixed = [a for a in p.args if a.kind not in ("param", "input")]
    if params:
        if len(params) != 1:
            return
        rest = t.value / p.value if p.kind == "product" else t.value - p.value
        b = b.bind_param(params[0].mode, rest)
        if b is None:
            return
    elif not close(p.value, t.value):
        return
    for found, left in place(fixed, list(t.args), b):
        yield from spread(slots, left, found, p.kind)


def place(fixed: list[Term], pool: list[Term], b: Binding) -> Iterator[tuple[Binding, list[Term]]]:
    """Each pattern part matched to a distinct target part, with the target parts left over."""
    if not fixed:
        yield b, pool
        return
    for i, t in enumerate(pool):
        for found in match(fixed[0], t, b):
            yield from place(fixed[1:], pool[:i] + pool[i + 1:], found)


def spread(slots: list[Term], left: list[Term], b: Binding, kind: str) -> Iterator[Binding]:
    if not slots:
        if not left:
            yield b
        return
    if len(slots) == 1:
        if left:
            whole = left[0] if len(left) == 1 else (product(1.0, left) if kind == "product" else total(0.0, left))
            if (found := b.bind_input(slots[0].mode, whole)) is not None:
                yield found
        return
    for i, t in enumerate(left):                         # several slots: one target part each, the last takes the rest
        if (found := b.bind_input(slots[0].mode, t)) is not None:
            yield from spread(slots[1:], left[:i] + left[i + 1:], found, kind)

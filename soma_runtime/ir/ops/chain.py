"""The `chain` op: elementwise ops with no kernel of their own, run as one (passes/chains.py makes it).

Its `steps` attr is the members in order as JSON, each `[op, [arguments], {attrs}]`, an argument
indexing the chain's inputs and then the results of the steps before it; the chain's output is the
last step's. Its meaning is its members' decompositions composed, so its formula is theirs: a backend
that compiles formulas (the CPU's generated jets) runs it as one loop, the atoms check it.
"""
from __future__ import annotations

import json

from soma_runtime.ir.atoms import Ref
from soma_runtime.ir.graph import TensorMeta
from soma_runtime.ir.ops.base import OPS, check, op


def steps_of(steps: str) -> list[tuple[str, list[int], dict]]:
    return [(name, args, attrs) for name, args, attrs in json.loads(steps)]


def written(steps: list[tuple[str, list[int], dict]]) -> str:
    """The `steps` attr of these members (op, argument indices, attrs)."""
    return json.dumps([[name, list(args), attrs] for name, args, attrs in steps], separators=(",", ":"))


def members(metas: list, steps: str) -> list:
    """Each input's and each step's meta, in argument order."""
    values = list(metas)
    for name, args, attrs in steps_of(steps):
        check(all(0 <= a < len(values) for a in args), f"a chain step of {name} reads a value not made before it")
        values.append(OPS[name].infer([values[a] for a in args], attrs)[0])
    return values


def chain_rule(metas, attrs):
    check(attrs["steps"] != "[]", "a chain has at least one step")
    return [members(metas, attrs["steps"])[-1]]


@op("chain", ["xs*"], chain_rule, attrs={"steps": "[]"})
def chain(A, *xs, steps):
    metas = [TensorMeta(x.shape, x.dtype) for x in xs]
    values, typed = list(xs), members(metas, steps)
    for name, args, attrs in steps_of(steps):
        out = OPS[name].decompose(A, *[values[a] for a in args], **OPS[name].full_attrs(attrs))
        meta = typed[len(values)]
        values.append(Ref(out.index, tuple(meta.shape), meta.dtype))     # a member after it may ask its dtype
    return values[-1]

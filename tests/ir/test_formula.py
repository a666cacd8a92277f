"""The structural formula hash: the same formula keys the same however it was built; another
formula keys differently. Built here as random atom DAGs, each in shuffled orders."""
from __future__ import annotations

import random

import pytest

from soma_runtime.ir.atoms import AtomGraph
from soma_runtime.ir.formula import formula_hash
from soma_runtime.ir.graph import TensorMeta

BINARY = [("mul", "mul"), ("add", "add"), ("add", "sub"), ("cmp", "max"), ("cmp", "lt")]
COMMUTATIVE = {("mul", "mul"), ("add", "add"), ("cmp", "max")}
UNARY = ["exp", "log", "sqrt", "tanh", "erf"]
LEAVES = 4                     # three inputs and the literal 0.5


def random_formula(seed: int, size: int = 12) -> list[tuple]:
    """A DAG as (atom, mode, argument indices): 0-2 the inputs, 3 a literal, 4 + i the i-th node."""
    rng = random.Random(seed)
    spec = []
    for i in range(size):
        args = (rng.randrange(LEAVES + i), rng.randrange(LEAVES + i))
        spec.append((*rng.choice(BINARY), args) if rng.random() < 0.6 else ("exp", rng.choice(UNARY), args[:1]))
    return spec


def build(spec: list[tuple], seed: int) -> str:
    """The hash of the formula with its nodes added in a random topological order, the literal made at
    a random point, and commutative arguments in a random order."""
    rng = random.Random(seed)
    A = AtomGraph([TensorMeta.of((4,), "f32")] * 3)
    refs = dict(enumerate(A.inputs))
    pending = list(range(len(spec)))
    while pending:
        if 3 not in refs and rng.random() < 0.3:
            refs[3] = A.lit(0.5)
        i = rng.choice([i for i in pending if all(a < LEAVES or a - LEAVES not in pending for a in spec[i][2])])
        pending.remove(i)
        atom, mode, args = spec[i]
        if 3 in args and 3 not in refs:
            refs[3] = A.lit(0.5)
        values = [refs[a] for a in args]
        if (atom, mode) in COMMUTATIVE and rng.random() < 0.5:
            values.reverse()
        refs[LEAVES + i] = A._add(atom, mode, values)
    A.outputs = [refs[LEAVES + len(spec) - 1].index]
    return formula_hash(A)


@pytest.mark.parametrize("seed", range(20))
def test_one_formula_built_in_shuffled_orders_has_one_hash(seed):
    spec = random_formula(seed)
    assert len({build(spec, order) for order in range(6)}) == 1


@pytest.mark.parametrize("seed", range(20))
def test_a_changed_mode_or_argument_order_changes_the_hash(seed):
    spec = random_formula(seed)
    last = LEAVES + len(spec) - 1
    assert build(spec + [("exp", "sin", (last,))], 0) != build(spec + [("exp", "cos", (last,))], 0)
    assert build(spec + [("add", "sub", (last, 0))], 0) != build(spec + [("add", "sub", (0, last))], 0)
    assert build(spec + [("cmp", "lt", (last, 1))], 0) != build(spec + [("cmp", "lt", (1, last))], 0)


def hash_of(fn) -> str:
    A = AtomGraph([TensorMeta.of((4,), "f32")] * 2)
    A.outputs = [fn(A, *A.inputs).index]
    return formula_hash(A)


@pytest.mark.parametrize("one,other", [
    (lambda A, x, w: A.mul(A.mul(x, A.lit(0.5)), w), lambda A, x, w: A.mul(A.lit(0.5), A.mul(w, x))),
    (lambda A, a, b: A.sub(a, b), lambda A, a, b: A.add(A.mul(b, A.lit(-1)), a)),
    (lambda A, v, _: A.exp("recip", A.exp("sqrt", v)), lambda A, v, _: A.exp("rsqrt", v)),
    (lambda A, x, _: A.exp("pow", x, A.lit(2)), lambda A, x, _: A.mul(x, x)),
    (lambda A, x, _: A.mul(x, A.exp("recip", A.lit(2 ** 0.5))), lambda A, x, _: A.mul(A.lit(0.70710677), x)),
], ids=["products", "differences", "rsqrt", "square", "division-by-a-literal"])
def test_the_algebra_exporters_write_differently_keys_alike(one, other):
    assert hash_of(one) == hash_of(other)

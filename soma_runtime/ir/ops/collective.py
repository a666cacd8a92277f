"""Collective ops: what the ranks of a tensor-parallel group (ir/collective.py) compute together.
Each rank's graph holds the same collectives in the same order; their meaning reads every rank's
value (the `ranks` read, a stack over the group) and combines it."""
from __future__ import annotations

from soma_runtime.ir.graph import TensorMeta
from soma_runtime.ir.ops.base import float_dtype, op


def summed_rule(metas, attrs):
    x = metas[0]
    float_dtype(x)
    return [TensorMeta(x.shape, x.dtype)]


@op("all_reduce", ["x"], summed_rule, any_rank=True)
def all_reduce(A, x):
    """x summed over the group's ranks (Megatron's row-parallel products meet here)."""
    return A.reduce("sum", A.read("ranks", x), axis=0, keepdims=False)

"""CUDA jet for the all_reduce op: the rank's rows summed over its group by NCCL, on the step's
stream (captured with the rest of a decode step)."""
from __future__ import annotations

from soma_runtime.backends.cuda.device import CUDA, F, device_jet
from soma_runtime.ir import collective
from soma_runtime.ir.jets import jet


@jet("all_reduce", CUDA, [(F,)])
@device_jet
def all_reduce(x):
    total = x.contiguous().clone()
    collective.summed_(total)
    return total

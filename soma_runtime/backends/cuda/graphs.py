"""CUDA graphs: a plan's whole run captured once and replayed, so a decode step costs one launch
from Python instead of hundreds. Host inputs are copied into static device buffers before each
replay, or on the device where they come as device tensors (an earlier step's tokens); shared inputs
(the KV pages) are captured as themselves and must be the same tensors every time, as the pool's are.
The captured kernels are chained (chain.py): each launched while the one before it finishes."""
from __future__ import annotations

import torch

from soma_runtime.backends.cuda.chain import chaining
from soma_runtime.backends.cuda.device import place
from soma_runtime.errors import GraphError


class GraphedPlan:
    def __init__(self, plan, inputs: dict, shared: set):
        """`shared`: the inputs captured as themselves (device tensors); the rest get buffers of their own."""
        self.plan = plan
        self.static = {name: value if name in shared else place(value).clone() for name, value in inputs.items()}
        # host inputs pass through pinned buffers: their copies to the device are then truly asynchronous
        self.staging = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                        for name, t in self.static.items() if name not in shared}
        self.copied = torch.cuda.Event()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with chaining():
            with torch.cuda.stream(side):                   # compile every kernel before capture
                plan.run(self.static)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = plan.run(self.static)

    def run(self, inputs: dict) -> list:
        self.copied.synchronize()                           # the last step's copies have left the buffers
        for name, value in inputs.items():
            target = self.static[name]
            if value is target:
                continue
            if name not in self.staging:
                raise GraphError(f"graph input {name!r} must be the tensor it was captured with")
            if isinstance(value, torch.Tensor):             # already on the device (an earlier step's output)
                target.copy_(value)
                continue
            stage = self.staging[name]
            stage.numpy()[...] = value
            target.copy_(stage, non_blocking=True)
        self.copied.record()
        self.graph.replay()
        return self.outputs


def graphed(plan, inputs: dict, shared: set) -> GraphedPlan:
    return GraphedPlan(plan, inputs, shared)

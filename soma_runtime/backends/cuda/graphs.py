"""CUDA graphs: a plan's whole run captured once and replayed, so a decode step costs one launch
from Python instead of hundreds. The host inputs of a step (tokens, positions, slots, spans, ...)
live in one device buffer and cross in one copy from one pinned buffer of the same layout (a copy per
input costs a turn of the copy engine each). Inputs that come as device tensors (an earlier step's
tokens) are copied on the device; shared inputs (the KV pages) are captured as themselves and must be
the same tensors every time, as the pool's are. The captured kernels are chained (chain.py): each
launched while the one before it finishes."""
from __future__ import annotations

from collections import OrderedDict

import torch

from soma_runtime.backends.cuda.chain import chaining
from soma_runtime.backends.cuda.device import place
from soma_runtime.errors import GraphError
from soma_runtime.ir.backend import Captures

ALIGN = 256            # each input's offset in the packed buffers
GRAPH_ROWS = 32        # steps of up to this many rows replay as one graph ...
GRAPH_CONTEXT = 512    # ... with the context padded to a multiple of this (one graph per size)
WHOLE_KEPT = 8         # whole runs captured (each holds its intermediates), the least recently replayed dropped first
WHOLE_BYTES = 4 << 30  # ... while the memory they hold together stays within this (the latest is always kept)


class GraphedPlan:
    def __init__(self, plan, inputs: dict, shared: set):
        """`shared`: the inputs captured as themselves (device tensors); the rest get places in the packed buffer."""
        self.plan = plan
        own = {name: place(value) for name, value in inputs.items() if name not in shared}
        offsets, size = {}, 0
        for name, t in own.items():
            offsets[name], size = size, size + -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.packed = torch.empty(max(size, ALIGN), dtype=torch.uint8, device=next(iter(own.values())).device)
        self.staging = torch.empty(self.packed.shape, dtype=torch.uint8, pin_memory=True)   # a truly asynchronous copy
        view = lambda buffer, name: buffer[offsets[name]: offsets[name] + own[name].numel() * own[name].element_size()] \
            .view(own[name].dtype).view(own[name].shape)
        self.static = {name: inputs[name] for name in shared}
        self.stage = {}
        for name, t in own.items():
            self.static[name] = view(self.packed, name)
            self.static[name].copy_(t)
            self.stage[name] = view(self.staging, name).numpy()
        self.copied = torch.cuda.Event()
        reserved = torch.cuda.memory_reserved()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with chaining():
            with torch.cuda.stream(side):                   # compile every kernel before capture
                plan.run(self.static)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = plan.run(self.static)
        self.nbytes = max(0, torch.cuda.memory_reserved() - reserved) + self.packed.nbytes   # its pool's, roughly

    def run(self, inputs: dict) -> list:
        self.copied.synchronize()                           # the last step's copy has left the staging buffer
        on_device = []
        for name, value in inputs.items():
            target = self.static[name]
            if value is target:
                continue
            if name not in self.stage:
                raise GraphError(f"graph input {name!r} must be the tensor it was captured with")
            if isinstance(value, torch.Tensor):             # already on the device (an earlier step's output)
                on_device.append((target, value))
            else:
                self.stage[name][...] = value
        self.packed.copy_(self.staging, non_blocking=True)
        for target, value in on_device:                     # after the packed copy, which holds stale bytes for them
            target.copy_(value)
        self.copied.record()
        self.graph.replay()
        return self.outputs


class GraphedSteps(Captures):
    """A model's decode-sized steps, each shape captured once and replayed; whole runs (an imported graph's,
    an encoder batch's) captured on their plan's second run, the most recent kept."""

    def __init__(self):
        self.graphs: dict[tuple[int, int], GraphedPlan] = {}     # by (id of the plan, context)
        self.whole: OrderedDict[int, GraphedPlan | None] = OrderedDict()   # by id of the plan; None: run once

    def context(self, rows: int, needed: int) -> int:
        return -(-needed // GRAPH_CONTEXT) * GRAPH_CONTEXT if rows <= GRAPH_ROWS else needed

    def run(self, plan, inputs: dict, shared: set, rows: int, context: int) -> list:
        if rows > GRAPH_ROWS or plan.hosted:                 # a host step's copies cannot be captured
            return plan.run(inputs)
        key = (id(plan), context)
        if key not in self.graphs:
            self.graphs[key] = GraphedPlan(plan, inputs, shared)
        return self.graphs[key].run(inputs)

    def replay(self, plan, inputs: dict) -> list:
        if plan.hosted or plan.compiled is None or not inputs:   # host copies, or sizes the data decides
            return plan.run(inputs)
        key = id(plan)
        if key not in self.whole:                           # a first run compiles; sizes seen once are not captured
            self.whole[key] = None
            return plan.run(inputs)
        self.whole.move_to_end(key)
        if self.whole[key] is None:
            self.whole[key] = GraphedPlan(plan, inputs, set())
            captured = [k for k, graphed in self.whole.items() if graphed is not None]
            held = sum(self.whole[k].nbytes for k in captured)
            for old in captured[:-1]:
                if len(captured) <= WHOLE_KEPT and held <= WHOLE_BYTES:
                    break
                held -= self.whole.pop(old).nbytes
                captured.remove(old)
        return self.whole[key].run(inputs)

    def forget(self, plan) -> None:
        for key in [key for key, graphed in self.graphs.items() if graphed.plan is plan]:
            del self.graphs[key]
        self.whole.pop(id(plan), None)

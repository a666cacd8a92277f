"""A Program: one graph made ready for one backend, the single way every task runs a graph.

It fuses the graph once, places its weights on the backend once (shared by all its plans), keeps a plan per
set of bound sizes (most recently used last) while they number at most `kept` and their arenas together stay
within `arena_bytes`, and runs a plan through the backend's captures (a device backend replays a captured step
of few rows, or a whole run of sizes seen before, as a CUDA graph). The runners of the tasks (generation's
stages, the encoder, whisper, bare graphs) only say which sizes a run binds; nothing else of planning is
theirs. Knows graphs, plans and backends; nothing of models, requests or sequences.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from soma_runtime.ir.backend import Backend
from soma_runtime.ir.graph import Graph
from soma_runtime.ir.passes import fuse
from soma_runtime.ir.plan import Plan, RunBudget

PLANS_KEPT = 64                  # plans kept, the least recently used dropped first past either bound
ARENAS_KEPT = 1 << 30            # bytes of their arenas together (one plan is always kept, whatever its size)


class Program:
    def __init__(self, graph: Graph, backend: Backend, recognition: bool = True, free: tuple[str, ...] = (),
                 kept: int = PLANS_KEPT, arena_bytes: int = ARENAS_KEPT):
        """`graph` is fused here, in place (without `recognition`, only the fuse pass's rules run).
        `free`: dims that take any size per run without a plan of their own (the decoder's context)."""
        self.graph, self.backend, self.free = graph, backend, free
        self.kept, self.arena_bytes = kept, arena_bytes
        self.fusions = fuse(graph, recognition, chains=backend.formulas)
        self.captures = backend.captures()          # steps captured and replayed, where the backend can
        self.placed: dict[str, object] = {}         # the graph's constants on the backend, by name
        self.plans: OrderedDict[tuple, Plan] = OrderedDict()

    def plan(self, bindings: Mapping[str, int], budget: RunBudget | None = None) -> Plan:
        """The plan of a run whose symbolic sizes are `bindings` (under `budget`), made on first need."""
        key = (tuple(sorted(bindings.items())), budget)
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            return plan
        plan = self.plans[key] = Plan(self.graph, self.backend, dict(bindings), free=self.free, placed=self.placed,
                                      budget=budget)
        while len(self.plans) > 1 and (len(self.plans) > self.kept or
                                       sum(p.arena.nbytes for p in self.plans.values()) > self.arena_bytes):
            self.captures.forget(self.plans.popitem(last=False)[1])
        return plan

    def run(self, bindings: Mapping[str, int], inputs: dict, budget: RunBudget | None = None) -> list:
        """One run at `bindings`: the graph's outputs, in its order."""
        return self.plan(bindings, budget).run(inputs)

    def replay(self, bindings: Mapping[str, int], inputs: dict, budget: RunBudget | None = None) -> list:
        """One whole run at `bindings` through the captures: the same sizes run again replay what was captured."""
        return self.captures.replay(self.plan(bindings, budget), inputs)

    def recapture(self) -> None:
        """Capture every step afresh as it next runs (the kernels it launches were chosen again)."""
        self.captures = self.backend.captures()

    def step(self, bindings: Mapping[str, int], inputs: dict, shared: set, rows: int, context: int) -> list:
        """One run that repeats (a decoder's or whisper's step, an encoder's batch) of `rows` rows over
        `context` positions (0: none), through the captures: `shared` inputs (KV pages) are the same
        tensors every time."""
        return self.captures.run(self.plan(bindings), inputs, shared, rows, context)

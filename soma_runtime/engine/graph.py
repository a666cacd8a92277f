"""The `graph` task's runner: a bare graph (built in code, or imported) run on named inputs.

The graph is fused once; a plan is made per set of input shapes (the most recent kept), so a graph
with symbolic dims (a batch, a length) runs at any size. Inputs are checked where they are given:
every name the graph takes and no other, each of its dtype and rank.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from soma_runtime.backends.base import Backend
from soma_runtime.dtypes import dtype_of
from soma_runtime.errors import GraphError, RequestError
from soma_runtime.ir.graph import Graph, TensorMeta
from soma_runtime.ir.passes import fuse
from soma_runtime.ir.plan import Plan, bindings_from

PLANS_KEPT = 8


class GraphRunner:
    def __init__(self, graph: Graph, backend: Backend):
        self.graph, self.backend = graph, backend
        self.fusions = fuse(graph)
        self.plans: OrderedDict[tuple, Plan] = OrderedDict()

    @property
    def inputs(self) -> dict[str, TensorMeta]:
        return dict(self.graph.inputs)

    @property
    def outputs(self) -> dict[str, TensorMeta]:
        return {name: self.graph.tensors[name] for name in self.graph.outputs}

    def check(self, inputs: dict) -> dict[str, np.ndarray]:
        """The inputs as arrays; RequestError naming the first that is missing, unknown, or of another dtype or rank."""
        if not isinstance(inputs, dict):
            raise RequestError(f"inputs must map input names to arrays, got {type(inputs).__name__}")
        missing, unknown = set(self.graph.inputs) - set(inputs), set(inputs) - set(self.graph.inputs)
        if missing or unknown:
            raise RequestError(f"the graph takes inputs {', '.join(self.graph.inputs)}"
                               + (f"; missing {', '.join(sorted(missing))}" if missing else "")
                               + (f"; unknown {', '.join(sorted(map(str, unknown)))}" if unknown else ""))
        arrays = {}
        for name, meta in self.graph.inputs.items():
            value = np.asarray(inputs[name])
            if dtype_of(value) != meta.dtype:
                raise RequestError(f"input {name!r} must be {meta.dtype}, got {dtype_of(value)}")
            if value.ndim != meta.ndim:
                raise RequestError(f"input {name!r} must have shape {list(meta.shape)}, got {list(value.shape)}")
            arrays[name] = value
        return arrays

    def run(self, inputs: dict) -> dict[str, np.ndarray]:
        arrays = self.check(inputs)
        key = tuple(arrays[name].shape for name in self.graph.inputs)
        if key in self.plans:
            self.plans.move_to_end(key)
        else:
            try:
                self.plans[key] = Plan(self.graph, self.backend, bindings_from(self.graph, arrays))
            except GraphError as e:          # sizes that disagree with the graph's own
                raise RequestError(str(e)) from None
            if len(self.plans) > PLANS_KEPT:
                self.plans.popitem(last=False)
        outputs = self.plans[key].run(arrays)
        return {name: np.asarray(self.backend.fetch(value)) for name, value in zip(self.graph.outputs, outputs)}

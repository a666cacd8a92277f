"""The `graph` task's runner: a bare graph (built in code, or imported) run on named inputs.

The graph runs as a Program (ir/program.py: fused once, a plan per set of input shapes, the most recent
kept; sizes run again replay a captured run where the backend captures), so a graph with symbolic dims (a
batch, a length) runs at any size. Inputs are checked where they are given:
every name the graph takes and no other, each of its dtype and shape. A graph family (an imported graph
that needs its inputs' sizes, or some of their values, to be built) is built once per distinct set.
Every run is held to a RunBudget (ir/plan.py: bytes of any one tensor, of the outputs, of the
intermediates at once; the defaults there), given per run or else the runner's.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from soma_runtime.dtypes import BY_NUMPY
from soma_runtime.errors import GraphError, RequestError
from soma_runtime.ir.backend import Backend
from soma_runtime.ir.graph import Graph, GraphFamily, TensorMeta
from soma_runtime.ir.plan import RunBudget, bindings_from
from soma_runtime.ir.program import Program

MEMBERS_KEPT = 8                 # a family's members, each a converted graph
DEFAULT_BUDGET = RunBudget()     # what a run may compute unless its runner or the run is given another


class GraphRunner:
    def __init__(self, graph: Graph, backend: Backend, recognition: bool = True, budget: RunBudget = DEFAULT_BUDGET):
        self.graph, self.backend, self.budget = graph, backend, budget
        self.program = Program(graph, backend, recognition)

    @property
    def fusions(self):
        return self.program.fusions

    @property
    def inputs(self) -> dict[str, TensorMeta]:
        return dict(self.graph.inputs)

    @property
    def outputs(self) -> dict[str, TensorMeta]:
        return {name: self.graph.tensors[name] for name in self.graph.outputs}

    def run(self, inputs: dict, budget: RunBudget | None = None) -> dict[str, np.ndarray]:
        arrays = check_inputs(self.graph.inputs, inputs)
        bindings = bindings_from(self.graph, arrays)
        try:
            self.program.plan(bindings, budget or self.budget)
        except GraphError as e:              # sizes that disagree with the graph's own
            raise RequestError(str(e)) from None
        outputs = self.program.replay(bindings, arrays, budget or self.budget)
        return {name: np.asarray(self.backend.fetch(value)) for name, value in zip(self.graph.outputs, outputs)}


def check_inputs(expected: dict[str, TensorMeta], inputs: dict) -> dict[str, np.ndarray]:
    """The inputs as arrays; RequestError naming the first that is missing, unknown, or of another dtype or rank."""
    if not isinstance(inputs, dict):
        raise RequestError(f"inputs must map input names to arrays, got {type(inputs).__name__}")
    missing, unknown = set(expected) - set(inputs), set(inputs) - set(expected)
    if missing or unknown:
        raise RequestError(f"the graph takes inputs {', '.join(expected)}"
                           + (f"; missing {', '.join(sorted(missing))}" if missing else "")
                           + (f"; unknown {', '.join(sorted(map(str, unknown)))}" if unknown else ""))
    arrays = {}
    for name, meta in expected.items():
        value = np.asarray(inputs[name])
        if BY_NUMPY.get(value.dtype) != meta.dtype:
            raise RequestError(f"input {name!r} must be {meta.dtype}, got {BY_NUMPY.get(value.dtype, value.dtype)}")
        if value.ndim != meta.ndim or any(isinstance(d, int) and d != n for d, n in zip(meta.shape, value.shape)):
            raise RequestError(f"input {name!r} must have shape {list(meta.shape)}, got {list(value.shape)}")
        arrays[name] = value
    return arrays


class FamilyRunner:
    """A GraphFamily run: each distinct set of input shapes and values builds (once) a graph of its own, run
    by a GraphRunner; the most recent are kept."""

    def __init__(self, family: GraphFamily, backend: Backend, recognition: bool = True, budget: RunBudget = DEFAULT_BUDGET):
        self.family, self.backend, self.recognition, self.budget = family, backend, recognition, budget
        self.members: OrderedDict[tuple, GraphRunner] = OrderedDict()

    @property
    def inputs(self) -> dict[str, TensorMeta]:
        return dict(self.family.inputs)

    @property
    def outputs(self) -> dict[str, TensorMeta]:
        return dict(self.family.outputs)

    @property
    def fusions(self) -> dict:
        """The fusions found in the member run last (none before the first run)."""
        return next(reversed(self.members.values())).fusions if self.members else {}

    def run(self, inputs: dict, budget: RunBudget | None = None) -> dict[str, np.ndarray]:
        arrays = check_inputs(self.family.inputs, inputs)
        values = {name: arrays.pop(name) for name in self.family.value_inputs}
        shapes = {name: a.shape for name, a in arrays.items()}
        key = (tuple(shapes.values()), tuple(v.tobytes() for v in values.values()))
        if key in self.members:
            self.members.move_to_end(key)
        else:
            self.members[key] = GraphRunner(self.family.build(values, shapes), self.backend, self.recognition, self.budget)
            if len(self.members) > MEMBERS_KEPT:
                self.members.popitem(last=False)
        return self.members[key].run(arrays, budget)


def graph_runner(source: Graph | GraphFamily, backend: Backend, recognition: bool = True,
                 budget: RunBudget = DEFAULT_BUDGET) -> GraphRunner | FamilyRunner:
    runner = FamilyRunner if isinstance(source, GraphFamily) else GraphRunner
    return runner(source, backend, recognition, budget)

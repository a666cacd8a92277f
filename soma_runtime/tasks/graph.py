"""The graph task: GraphModel, a bare graph run from named inputs to named outputs."""
from __future__ import annotations

from collections import Counter

import numpy as np

from soma_runtime import loaders
from soma_runtime.engine.graph import FamilyRunner, GraphRunner, graph_runner
from soma_runtime.ir.backend import Backend, Precision
from soma_runtime.ir.graph import Graph
from soma_runtime.ir.plan import RunBudget
from soma_runtime.tasks.base import Model


class GraphModel(Model):
    """A bare graph: named inputs in, named outputs out."""

    task = "graph"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, runner: GraphRunner | FamilyRunner):
        super().__init__(model_id, loaded, backend)
        self.runner = runner

    @classmethod
    def open(cls, model_id: str, loaded: loaders.LoadedModel, backend: Backend, precision: Precision, n_ctx: int | None,
             bar, autotune: bool) -> GraphModel:
        return cls(model_id, loaded, backend, graph_runner(loaded.graph, backend))

    @property
    def inputs(self) -> dict:
        """Input name -> TensorMeta (shape, symbolic dims included, and dtype)."""
        return self.runner.inputs

    @property
    def outputs(self) -> dict:
        return self.runner.outputs

    def run(self, inputs: dict, budget: RunBudget | None = None) -> dict[str, np.ndarray]:
        """The graph's outputs by name, for arrays given by input name; every size the graph computes held to
        `budget` (the runner's default: engine.graph.DEFAULT_BUDGET) before it is allocated."""
        return self.runner.run(inputs, budget)

    def weight_bytes(self) -> int:
        graph = self.graph
        return sum(int(v.nbytes) for v in graph.constants.values()) if graph else 0

    @property
    def graph(self) -> Graph | None:
        """The graph run (for a family: the member run last; None before its first run)."""
        if isinstance(self.runner, GraphRunner):
            return self.runner.graph
        return next(reversed(self.runner.members.values())).graph if self.runner.members else None

    def info(self) -> dict:
        meta = lambda m: {"shape": [str(d) for d in m.shape], "dtype": m.dtype}
        return {**super().info(), **self.loaded.metadata, "inputs": {n: meta(m) for n, m in self.inputs.items()},
                "outputs": {n: meta(m) for n, m in self.outputs.items()},
                "ops": dict(sorted(Counter(n.op for n in self.graph.nodes).items())) if self.graph else {},
                "fusions": dict(self.runner.fusions)}

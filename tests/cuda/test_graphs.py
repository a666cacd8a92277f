"""CUDA graphs (backends/cuda/graphs.py): a plan with a step that runs on the host for the device (its inputs
copied there and back) is run, not captured: a copy to or from the host cannot be captured (on the H100 the
tq3j cache with sinks, whose copies' attention has no cuda jet, failed in capture before)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.backends import BACKENDS

pytestmark = pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")


def test_a_plan_with_a_host_step_runs_uncaptured_and_one_without_is_not_marked():
    from soma_runtime.backends import get
    from soma_runtime.backends.cuda.graphs import GraphedSteps
    from soma_runtime.ir.builder import GraphBuilder
    from soma_runtime.ir.plan import Plan

    cuda = get("cuda")
    g = GraphBuilder()
    hosted = Plan(g.output(g.nonzero(g.relu(g.input("x", (6,), "f32")))), cuda)     # nonzero: no cuda jet
    g = GraphBuilder()
    on_device = Plan(g.output(g.relu(g.input("x", (6,), "f32"))), cuda)
    assert hosted.hosted and not on_device.hosted
    x = np.array([1, -2, 3, -4, 5, 6], np.float32)
    steps = GraphedSteps()
    got = steps.run(hosted, {"x": x}, set(), rows=1, context=1)
    assert not steps.graphs
    np.testing.assert_array_equal(np.asarray(cuda.fetch(got[0])), np.array([[0, 2, 4, 5]]))


def test_a_whole_run_is_captured_on_its_plans_second_run_and_the_most_recent_are_kept(monkeypatch):
    """Program.replay's policy: a plan's first run compiles, uncaptured; its second is captured and replayed
    after; past WHOLE_KEPT captured plans, or past WHOLE_BYTES held by them, the least recently replayed is
    dropped (the latest always kept; a hosted plan is never captured)."""
    from soma_runtime.backends import get
    from soma_runtime.backends.cuda import graphs
    from soma_runtime.ir.builder import GraphBuilder
    from soma_runtime.ir.program import Program

    made = []

    class Recorded:                            # a capture without a GPU: the plan run as it is, the capture counted
        def __init__(self, plan, inputs, shared):
            self.plan, self.nbytes = plan, 100 * plan.bindings["B"]      # what its pool holds, say
            made.append(plan)

        def run(self, inputs):
            return self.plan.run(inputs)

    monkeypatch.setattr(graphs, "GraphedPlan", Recorded)
    monkeypatch.setattr(graphs, "WHOLE_KEPT", 2)
    g = GraphBuilder()
    program = Program(g.output(g.relu(g.input("x", ("B",), "f32"))), get("cuda"))
    program.captures = graphs.GraphedSteps()    # what the backend captures with on a GPU (the interpreter: none)
    run = lambda b: np.asarray(get("cuda").fetch(program.replay({"B": b}, {"x": np.full(b, -1.0 + b, np.float32)})[0]))
    assert run(1).tolist() == [0.0] and not made                  # first run: not captured
    assert run(1).tolist() == [0.0] and len(made) == 1            # second: captured
    run(1)
    assert len(made) == 1                                         # replayed, not captured again
    for b in (2, 2, 3, 3):
        assert run(b).tolist() == [b - 1.0] * b
    assert len(made) == 3 and list(program.captures.whole) == [id(program.plan({"B": 2})), id(program.plan({"B": 3}))]
    monkeypatch.setattr(graphs, "WHOLE_BYTES", 450)                     # past the bytes: the older dropped first
    run(4), run(4)
    assert list(program.captures.whole) == [id(program.plan({"B": 4}))]
    run(5), run(5)                                                       # alone past them: the latest is kept
    assert list(program.captures.whole) == [id(program.plan({"B": 5}))] and run(5).tolist() == [4.0] * 5
    g = GraphBuilder()
    hosted = Program(g.output(g.nonzero(g.input("x", ("B",), "f32"))), get("cuda"))
    hosted.captures = graphs.GraphedSteps()
    for _ in range(3):
        hosted.replay({"B": 2}, {"x": np.ones(2, np.float32)})
    assert len(made) == 5

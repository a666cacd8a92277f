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

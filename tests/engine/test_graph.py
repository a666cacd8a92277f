"""The `graph` task: a Graph built in code runs by name through the library, fused (an exporter-style
layernorm is recognized), at any size its symbolic dims allow, against torch; bad inputs are
RequestErrors naming them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from soma_runtime.errors import RequestError
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.tasks import Runtime
from tests.ir.test_fuse import layernorm_pow_div

RNG = np.random.default_rng(0)
W, B = RNG.standard_normal(16).astype(np.float32), RNG.standard_normal(16).astype(np.float32)


@pytest.fixture(scope="module")
def model():
    g = GraphBuilder()
    x = g.input("x", ("N", 16), "f32")
    normed = layernorm_pow_div(g, x, g.const("w", W), g.const("b", B))
    return Runtime("cpu").load(g.output(g.gelu(normed)), progress=False)


def test_a_graph_runs_by_name_at_any_size_against_torch(model):
    assert model.task == "graph" and list(model.inputs) == ["x"] and model.info()["fusions"]["recognized layernorm"] == 1
    for rows in (1, 5, 3):
        x = RNG.standard_normal((rows, 16)).astype(np.float32)
        (name, got), = model.run({"x": x}).items()
        want = F.gelu(F.layer_norm(torch.from_numpy(x), (16,), torch.from_numpy(W), torch.from_numpy(B), 1e-5)).numpy()
        assert name == model.loaded.graph.outputs[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("inputs,needle", [
    ({}, "missing x"),
    ({"x": np.zeros((2, 16), np.float32), "y": np.zeros(1)}, "unknown y"),
    ({"x": np.zeros((2, 16), np.float64)}, "must be f32"),
    ({"x": np.zeros(16, np.float32)}, "must have shape"),
    ({"x": np.zeros((2, 15), np.float32)}, "must have shape \\[N, 16\\], got \\[2, 15\\]"),
])
def test_bad_inputs_are_request_errors_naming_them(model, inputs, needle):
    with pytest.raises(RequestError, match=needle):
        model.run(inputs)

"""`POST /v1/run`: a graph model served by name, inputs and outputs as JSON arrays (the answer equal to
the library's run), errors as 400s naming what is wrong; other tasks' routes refuse it."""
from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from soma_runtime.server.app import create_app
from soma_runtime.server.registry import ModelRegistry
from soma_runtime.tasks import Runtime
from tests.engine.test_graph import B, W
from tests.ir.test_fuse import layernorm_pow_div


@pytest.fixture(scope="module")
def client():
    from soma_runtime.ir.builder import GraphBuilder
    g = GraphBuilder()
    x = g.input("x", ("N", 16), "f32")
    graph = g.output(g.sqrt(layernorm_pow_div(g, x, g.const("w", W), g.const("b", B))))     # NaN where the norm is < 0
    registry = ModelRegistry(Runtime("cpu"), memory_budget=2**30)
    registry.load(graph, "ln")
    with TestClient(create_app(registry)) as c:
        yield c, registry.get("ln").model


def test_a_graph_runs_over_http_as_in_the_library(client):
    c, model = client
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    r = c.post("/v1/run", json={"model": "ln", "inputs": {"x": x.tolist()}})
    assert r.status_code == 200, r.text
    (name, want), = model.run({"x": x}).items()
    got = np.array([[np.nan if v == "NaN" else v for v in row] for row in r.json()["outputs"][name]], np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(want).any()


@pytest.mark.parametrize("body,needle", [
    ({"model": "ln", "inputs": {"y": [1.0]}}, "no input 'y'"),
    ({"model": "ln", "inputs": {"x": [[1.0, 2.0], [3.0]]}}, "not a rectangular array"),
    ({"model": "ln", "inputs": {"x": [1.0] * 16}}, "must have shape"),
    ({"model": "ln", "inputs": "x"}, "inputs"),
])
def test_bad_inputs_are_400s_naming_them(client, body, needle):
    r = client[0].post("/v1/run", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_other_tasks_routes_refuse_a_graph(client):
    r = client[0].post("/v1/completions", json={"model": "ln", "prompt": "hi"})
    assert r.status_code == 400 and "graph task" in r.json()["error"]["message"]


def test_an_onnx_file_is_served_on_v1_run_as_onnxruntime_runs_it():
    """Silero VAD (If subgraphs on the `sr` input, an LSTM): one chunk over HTTP, equal to onnxruntime's."""
    ort = pytest.importorskip("onnxruntime")
    silero_vad = pytest.importorskip("silero_vad")
    import os
    path = os.path.join(os.path.dirname(silero_vad.__file__), "data", "silero_vad.onnx")
    registry = ModelRegistry(Runtime("cpu"), memory_budget=2**30)
    registry.load(path, "vad")
    chunk = (np.random.default_rng(2).standard_normal((1, 576)) * 0.1).astype(np.float32)
    state = np.zeros((2, 1, 128), np.float32)
    with TestClient(create_app(registry)) as c:
        r = c.post("/v1/run", json={"model": "vad", "inputs": {"input": chunk.tolist(), "state": state.tolist(), "sr": 16000}})
    assert r.status_code == 200, r.text
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(
        None, {"input": chunk, "state": state, "sr": np.array(16000, np.int64)})
    np.testing.assert_allclose(np.array(r.json()["outputs"]["output"], np.float32), want[0], atol=1e-5)
    np.testing.assert_allclose(np.array(r.json()["outputs"]["stateN"], np.float32), want[1], atol=1e-5)


def test_a_run_past_the_servers_budget_is_a_400_before_it_computes():
    from soma_runtime.ir.builder import GraphBuilder
    from soma_runtime.ir.plan import RunBudget
    g = GraphBuilder()
    x = g.input("x", ("N", 16), "f32")
    registry = ModelRegistry(Runtime("cpu"), memory_budget=2**30)
    registry.load(g.output(g.gelu(x)), "gelu")
    with TestClient(create_app(registry, run_budget=RunBudget(tensor_bytes=1024))) as c:
        small, large = ([[0.5] * 16] * rows for rows in (16, 17))        # 16 rows of f32: 1024 bytes
        assert c.post("/v1/run", json={"model": "gelu", "inputs": {"x": small}}).status_code == 200
        r = c.post("/v1/run", json={"model": "gelu", "inputs": {"x": large}})
        assert r.status_code == 400 and "past the 1024 a tensor may have" in r.json()["error"]["message"], r.text

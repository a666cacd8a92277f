"""Graphs that compute hostile sizes, indices and structures (`Runtime().load(x).run`, `run --model x.onnx`,
`/v1/run`): each a typed error naming the node, raised before anything of that size is allocated or
written, in bounded time; and a large answer that leaves the server's event loop free."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest
from fastapi.testclient import TestClient
from onnx import TensorProto, helper, numpy_helper

from soma_runtime.backends import get
from soma_runtime.cli.main import main
from soma_runtime.engine.graph import graph_runner
from soma_runtime.errors import ModelLoadError, RequestError, UnsupportedModelError
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.ir.plan import RunBudget
from soma_runtime.loaders.onnx import convert
from soma_runtime.server.app import create_app
from soma_runtime.server.registry import ModelRegistry
from soma_runtime.server.routes.graph import ANSWER_VALUES
from soma_runtime.tasks import Runtime

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def info(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def const(name: str, value) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def saved(tmp_path, nodes, inputs, outputs, initializers=(), name="model.onnx") -> str:
    graph = helper.make_graph(nodes, "hostile", inputs, outputs, list(initializers))
    path = str(tmp_path / name)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def load(path: str):
    return Runtime("cpu").load(path, progress=False)


def expand_model(tmp_path, shape) -> str:
    """y = x (3 floats: 12 bytes) expanded to `shape`."""
    return saved(tmp_path, [helper.make_node("Expand", ["x", "shape"], ["y"], name="grow")], [info("x", F, [3])],
                 [info("y", F, None)], [const("shape", np.array(shape, np.int64))])


def range_model(tmp_path) -> str:
    """y = 0, 1, ... below `limit` (an input: the graph is built for its value)."""
    return saved(tmp_path, [helper.make_node("Range", ["zero", "limit", "one"], ["y"], name="count")],
                 [info("limit", I64, [])], [info("y", I64, ["n"])], [const("zero", np.int64(0)), const("one", np.int64(1))])


def summed_range_model(tmp_path) -> str:
    """y = 0, 1, ... below the sum of 100 floats: a length only the data decides, bound as the graph runs."""
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             helper.make_node("Range", ["zero", "total", "one"], ["y"], name="count")]
    return saved(tmp_path, nodes, [info("x", F, [100])], [info("y", F, None)],
                 [const("zero", np.float32(0)), const("one", np.float32(1))])


def summed(first: float) -> np.ndarray:
    x = np.zeros(100, np.float32)
    x[0] = first
    return x


# --- sizes a graph computes (fault 9) -----------------------------------------------------------

def test_an_expand_of_12_bytes_to_1e5_by_1e5_by_3_is_a_request_error_naming_the_node(tmp_path):
    model = load(expand_model(tmp_path, [100_000, 100_000, 3]))
    with pytest.raises(RequestError, match=r"node 'grow' \(expand\).*\[100000, 100000, 3\] f32 is 120000000000 bytes"):
        model.run({"x": np.ones(3, np.float32)})


def test_the_cli_writes_no_output_file_for_an_expand_to_1e4_by_1e4_by_3(tmp_path, capsys):
    path = expand_model(tmp_path, [10_000, 10_000, 3])                        # 1.2 GB from a 12-byte input
    np.save(tmp_path / "x.npy", np.ones(3, np.float32))
    out = tmp_path / "out"
    assert main(["run", "--model", path, "--input", f"x={tmp_path / 'x.npy'}", "--output-dir", str(out),
                 "--backend", "cpu"]) == 1
    assert "node 'grow' (expand)" in capsys.readouterr().err
    assert not out.exists() or not os.listdir(out)


@pytest.mark.parametrize("limit", [10**12, 2**63 - 1])
def test_a_range_to_1e12_or_int64_max_is_a_request_error_not_an_allocation_or_an_empty_answer(tmp_path, limit):
    model = load(range_model(tmp_path))
    with pytest.raises(RequestError, match=rf"node 'count' \(range\).*\[{limit}\] i64 is {8 * limit} bytes"):
        model.run({"limit": np.array(limit, np.int64)})
    np.testing.assert_array_equal(model.run({"limit": np.array(4, np.int64)})["y"], np.arange(4))


def test_a_range_whose_length_the_data_decides_is_checked_before_it_is_allocated(tmp_path):
    model = load(summed_range_model(tmp_path))
    with pytest.raises(RequestError, match=r"node 'count' \(range\).*past the 1073741824 a tensor may have"):
        model.run({"x": summed(1e12)})
    np.testing.assert_array_equal(model.run({"x": summed(3)})["y"], np.arange(3, dtype=np.float32))


def test_an_expand_to_a_size_the_data_decides_is_checked_before_it_is_allocated(tmp_path):
    """Expand(1, [n, n]) where n is a range's length: the node that decides n runs, though only its shape is read."""
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             helper.make_node("Range", ["zero", "total", "one"], ["r"], name="count"),
             helper.make_node("Shape", ["r"], ["n"]), helper.make_node("Concat", ["n", "n"], ["nn"], axis=0),
             helper.make_node("Expand", ["one", "nn"], ["y"], name="square")]
    model = load(saved(tmp_path, nodes, [info("x", F, [100])], [info("y", F, None)],
                       [const("zero", np.float32(0)), const("one", np.float32(1))]))
    np.testing.assert_array_equal(model.run({"x": summed(3)})["y"], np.ones((3, 3), np.float32))
    with pytest.raises(RequestError, match=r"node 'square' \(expand\).*\[100000, 100000\] f32 is 40000000000 bytes"):
        model.run({"x": summed(1e5)})


def test_a_constant_of_shape_1e6_by_1e6_is_a_request_error(tmp_path):
    model = load(saved(tmp_path, [helper.make_node("ConstantOfShape", ["shape"], ["y"], name="fill")],
                       [info("shape", I64, [2])], [info("y", F, ["a", "b"])]))
    with pytest.raises(RequestError, match=r"node 'fill' \(expand\).*\[1000000, 1000000\] f32"):
        model.run({"shape": np.array([10**6, 10**6])})
    assert model.run({"shape": np.array([2, 3])})["y"].shape == (2, 3)


def test_a_constant_computed_at_load_past_the_fold_limit_is_left_to_the_run_and_its_budget(tmp_path):
    """ConstantOfShape of a shape the file writes: a 4 TB constant is never computed at load."""
    path = saved(tmp_path, [helper.make_node("ConstantOfShape", ["shape"], ["big"], name="fill"),
                            helper.make_node("Add", ["x", "big"], ["y"], name="sum")],
                 [info("x", F, [1])], [info("y", F, None)], [const("shape", np.array([10**6, 10**6], np.int64))])
    model = load(path)
    with pytest.raises(RequestError, match=r"node 'fill' \(expand\).*4000000000000 bytes"):
        model.run({"x": np.ones(1, np.float32)})


def test_a_resize_by_1e5_is_refused_at_load_before_its_map_is_built(tmp_path):
    path = saved(tmp_path, [helper.make_node("Resize", ["x", "", "scales"], ["y"], name="zoom", mode="linear")],
                 [info("x", F, [1, 1, 2, 2])], [info("y", F, None)], [const("scales", np.array([1, 1, 1e5, 1e5], np.float32))])
    start = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match=r"node 'zoom' \(Resize, opset 17\): resizing axis 2 from 2 to 200000"):
        load(path)
    assert time.perf_counter() - start < 5


def tiny_graph():
    """y = x + 1 and z = x * 2 for x of n floats."""
    g = GraphBuilder()
    x = g.input("x", ("n",), "f32")
    one = g.const("one", np.ones(1, np.float32))
    return g.output(g.add(x, one), g.mul(x, g.const("two", np.full(1, 2, np.float32))))


@pytest.mark.parametrize("budget,needle", [
    (RunBudget(tensor_bytes=1000), r"its output '\w+' of shape \[1000\] f32 is 4000 bytes, past the 1000"),
    (RunBudget(output_bytes=6000), r"the graph's outputs \w+, \w+ come to 8000 bytes, past the 6000"),
])
def test_a_budget_given_per_run_bounds_each_tensor_and_the_outputs_together(budget, needle):
    runner = graph_runner(tiny_graph(), get("cpu"))
    x = np.ones(1000, np.float32)
    with pytest.raises(RequestError, match=needle):
        runner.run({"x": x}, budget)
    assert [v.shape for v in runner.run({"x": x}).values()] == [(1000,), (1000,)]     # the default budget is wider


def test_the_intermediates_a_run_holds_at_once_are_bounded_by_the_work_budget():
    g = GraphBuilder()
    x = g.input("x", ("n",), "f32")
    graph = g.output(g.reduce_sum(g.exp(g.exp(x)), axes=(0,)))
    with pytest.raises(RequestError, match=r"holds \d+ bytes of intermediates at once, past the 4096"):
        graph_runner(graph, get("cpu"), budget=RunBudget(work_bytes=4096)).run({"x": np.ones(4096, np.float32)})


# --- indices and bounds from the data (fault 10) ------------------------------------------------

@pytest.mark.parametrize("index", [10**9, -5])
def test_a_gather_index_out_of_range_is_a_request_error_naming_the_node(tmp_path, index):
    model = load(saved(tmp_path, [helper.make_node("Gather", ["x", "i"], ["y"], name="pick")],
                       [info("x", F, [3, 4]), info("i", I64, [100])], [info("y", F, None)]))
    indices = np.zeros(100, np.int64)
    indices[7] = index
    with pytest.raises(RequestError, match=rf"node 'pick' \(take\): IndexError: index {index} is out of bounds"):
        model.run({"x": np.ones((3, 4), np.float32), "i": indices})
    assert model.run({"x": np.ones((3, 4), np.float32), "i": np.full(100, -3)})["y"].shape == (100, 4)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_sum_of_nan_or_inf_into_range_is_a_request_error(tmp_path, bad):
    model = load(summed_range_model(tmp_path))
    with pytest.raises(RequestError, match=r"node 'count' \(range\).*has no length"):
        model.run({"x": summed(bad)})


# --- /v1/run: budgets as 400s, a large answer off the event loop (fault 11) ---------------------

@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    registry = ModelRegistry(Runtime("cpu"), memory_budget=2**30)
    registry.load(expand_model(folder, [100_000, 100_000, 3]), "huge")
    wide = saved(folder, [helper.make_node("Expand", ["x", "shape"], ["y"], name="grow")], [info("x", F, [])],
                 [info("y", F, None)], [const("shape", np.array([2048, 1024], np.int64))], name="wide.onnx")
    registry.load(wide, "wide")                                                # 2048 x 1024 = ANSWER_VALUES numbers
    registry.load(saved(folder, [helper.make_node("Expand", ["x", "shape"], ["y"], name="grow")], [info("x", F, [])],
                        [info("y", F, None)], [const("shape", np.array([ANSWER_VALUES + 1], np.int64))],
                        name="wider.onnx"), "wider")
    with TestClient(create_app(registry)) as c:
        yield c


def test_v1_run_of_a_size_past_the_budget_is_a_400_naming_the_node(client):
    r = client.post("/v1/run", json={"model": "huge", "inputs": {"x": [1.0, 2.0, 3.0]}})
    assert r.status_code == 400 and "node 'grow' (expand)" in r.json()["error"]["message"], r.text


def test_v1_run_refuses_an_answer_of_more_numbers_than_it_may_hold(client):
    r = client.post("/v1/run", json={"model": "wider", "inputs": {"x": 1.5}})
    assert r.status_code == 400 and f"past the {ANSWER_VALUES} an answer may hold" in r.json()["error"]["message"], r.text


def test_v1_run_answers_two_million_numbers_while_health_keeps_answering(client):
    answered, worst, polls = {}, 0.0, 0

    def run():
        answered["reply"] = client.post("/v1/run", json={"model": "wide", "inputs": {"x": 0.25}})
    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive():
        start = time.perf_counter()
        assert client.get("/v1/health").status_code == 200
        worst, polls = max(worst, time.perf_counter() - start), polls + 1
        time.sleep(0.01)
    thread.join()
    reply = answered["reply"]
    assert reply.status_code == 200, reply.text[:300]
    y = np.array(json.loads(reply.content)["outputs"]["y"], np.float32)
    assert y.shape == (2048, 1024) and (y == 0.25).all()
    assert polls >= 3 and worst < 0.5, (polls, worst)


# --- loading (fault 12) -------------------------------------------------------------------------

def test_a_concat_of_20000_inputs_loads_and_runs_in_seconds(tmp_path):
    path = saved(tmp_path, [helper.make_node("Concat", ["x"] * 20_000, ["y"], name="join", axis=0)],
                 [info("x", F, [1])], [info("y", F, [20_000])])
    start = time.perf_counter()
    np.testing.assert_array_equal(load(path).run({"x": np.full(1, 7, np.float32)})["y"], np.full(20_000, 7, np.float32))
    assert time.perf_counter() - start < 20


def nested_loops(depth: int, trips, trip_nodes=()) -> list:
    """Loops `depth` deep, each running `trips` times (a tensor named `trips`), the innermost adding 1 to v."""
    body = helper.make_graph([helper.make_node("Identity", ["c_in"], ["c_out"]),
                              helper.make_node("Add", ["v_in", "one"], ["v_out"])], "body",
                             [info("i", I64, []), info("c_in", BOOL, []), info("v_in", F, [1])],
                             [info("c_out", BOOL, []), info("v_out", F, [1])], [const("one", np.ones(1, np.float32))])
    for level in range(depth - 1):
        body = helper.make_graph([helper.make_node("Identity", ["c_in"], ["c_out"]),
                                  helper.make_node("Loop", ["trips", "", "v_in"], ["v_out"], body=body, name=f"loop{level}")],
                                 "body", [info("i", I64, []), info("c_in", BOOL, []), info("v_in", F, [1])],
                                 [info("c_out", BOOL, []), info("v_out", F, [1])])
    return [*trip_nodes, helper.make_node("Loop", ["trips", "", "x"], ["y"], body=body, name="outer")]


def test_a_loop_of_1000_steps_nested_3_deep_is_refused_at_once(tmp_path):
    path = saved(tmp_path, nested_loops(3, 1000), [info("x", F, [1])], [info("y", F, [1])],
                 [const("trips", np.int64(1000))])
    start = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match=r"more than 100000 nodes \(loops unrolled\)"):
        load(path)
    assert time.perf_counter() - start < 2


def test_loops_whose_trip_counts_are_computed_are_bounded_as_they_unroll(tmp_path, monkeypatch):
    computed = [helper.make_node("Add", ["half", "half"], ["trips"])]            # 2 x 25: no count the file writes
    path = saved(tmp_path, nested_loops(2, 50, computed), [info("x", F, [1])], [info("y", F, [1])],
                 [const("half", np.int64(25))])
    np.testing.assert_array_equal(load(path).run({"x": np.zeros(1, np.float32)})["y"], [2500])
    monkeypatch.setattr(convert, "MAX_NODES", 1000)
    with pytest.raises(UnsupportedModelError, match=r"more than 1000 nodes \(loops unrolled\)"):
        load(path)


ADD = [helper.make_node("Add", ["x", "w"], ["y"], name="add")]


def test_an_input_declared_with_a_negative_dim_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match=r"'x' is declared with dim 1 of -3"):
        load(saved(tmp_path, ADD, [info("x", F, [2, -3])], [info("y", F, None)], [const("w", np.ones(1, np.float32))]))


def test_an_output_no_node_produces_is_a_load_error_naming_it(tmp_path):
    with pytest.raises(ModelLoadError, match=r"output 'nowhere' is not produced by any node"):
        load(saved(tmp_path, ADD, [info("x", F, [3])], [info("nowhere", F, None)], [const("w", np.ones(1, np.float32))]))


def test_an_attribute_its_op_does_not_have_is_a_load_error_even_in_a_branch_never_taken(tmp_path):
    odd = helper.make_graph([helper.make_node("Identity", ["x"], ["odd"], name="copy", bogus=3)], "else", [],
                            [info("odd", F, None)])
    plain = helper.make_graph([helper.make_node("Identity", ["x"], ["plain"])], "then", [], [info("plain", F, None)])
    path = saved(tmp_path, [helper.make_node("If", ["truth"], ["y"], name="choose", then_branch=plain, else_branch=odd)],
                 [info("x", F, [3])], [info("y", F, None)], [const("truth", np.array(True))])
    with pytest.raises(ModelLoadError, match=r"node 'copy' \(Identity, opset 17\): attribute 'bogus' is not one of the op's"):
        load(path)


def test_an_axis_past_the_rank_is_a_load_error_not_wrapped_around(tmp_path):
    with pytest.raises(ModelLoadError, match=r"node 'join' \(Concat, opset 17\): axis 5 is out of range for a tensor of rank 1"):
        load(saved(tmp_path, [helper.make_node("Concat", ["x", "x"], ["y"], name="join", axis=5)], [info("x", F, [3])],
                   [info("y", F, None)]))


def external(dims, **fields) -> TensorProto:
    tensor = TensorProto(name="w", data_type=F, dims=dims, data_location=TensorProto.EXTERNAL)
    for key, value in fields.items():
        tensor.external_data.add(key=key, value=value)
    return tensor


def test_external_data_at_an_offset_that_is_text_is_a_load_error(tmp_path):
    (tmp_path / "w.bin").write_bytes(bytes(12))
    with pytest.raises(ModelLoadError, match=r"tensor 'w': its external data offset 'twelve' .* must be byte counts"):
        load(saved(tmp_path, ADD, [info("x", F, [3])], [info("y", F, None)],
                   [external([3], location="w.bin", offset="twelve")]))


@pytest.mark.parametrize("where", ["inline", "external"])
def test_tensor_dims_whose_product_overflows_are_load_errors(tmp_path, where):
    (tmp_path / "w.bin").write_bytes(bytes(12))
    dims = [2**62, 2**62]
    tensor = TensorProto(name="w", data_type=F, dims=dims) if where == "inline" else external(dims, location="w.bin")
    with pytest.raises(ModelLoadError, match=r"tensor 'w' of shape \[4611686018427387904, 4611686018427387904\]"):
        load(saved(tmp_path, ADD, [info("x", F, [3])], [info("y", F, None)], [tensor]))


def test_a_sparse_8_gb_external_file_past_the_address_space_is_a_load_error(tmp_path):
    """Mapped under an address-space cap (as a server with a memory limit maps it): ModelLoadError, not OSError."""
    with open(tmp_path / "w.bin", "wb") as f:
        f.truncate(8 << 30)
    path = saved(tmp_path, ADD, [info("x", F, [3])], [info("y", F, None)], [external([2 << 30], location="w.bin")])
    os.mkdir(tmp_path / "case")
    os.rename(path, tmp_path / "case" / "model.onnx")
    os.rename(tmp_path / "w.bin", tmp_path / "case" / "w.bin")
    run = subprocess.run([sys.executable, "-m", "tests.hardening.fuzz_graph_worker", str(1 << 30), str(tmp_path / "case")],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    (result,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert result["outcome"] == "ModelLoadError" and "cannot map its 8589934592 bytes" in result["detail"], result

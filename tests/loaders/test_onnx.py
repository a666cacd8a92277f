"""ONNX files through the public API and the CLI, against onnxruntime on the same file; and bad files:
each a typed error naming the file (and the node, where one is at fault)."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from soma_runtime.cli.main import main
from soma_runtime.errors import ModelLoadError, RequestError, UnsupportedModelError
from soma_runtime.tasks import Runtime

ort = pytest.importorskip("onnxruntime")
rng = np.random.default_rng(0)


def mlp(hidden: int = 8, declared_out=("batch", 4), weight_shape=None) -> onnx.ModelProto:
    """y = softmax(relu(x @ W + b) @ V); batch symbolic; W also a graph input with a default (an initializer)."""
    w = numpy_helper.from_array(rng.standard_normal(weight_shape or (6, hidden)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b")
    v = numpy_helper.from_array(rng.standard_normal((hidden, 4)).astype(np.float32), "V")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"], name="proj"),
             helper.make_node("Add", ["xw", "b"], ["h"], name="bias"),
             helper.make_node("Relu", ["h"], ["a"], name="act"),
             helper.make_node("MatMul", ["a", "V"], ["logits"], name="out"),
             helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=-1)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6]),
                                             helper.make_tensor_value_info("W", TensorProto.FLOAT, [6, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(declared_out))], [w, b, v])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def save(model: onnx.ModelProto, directory, name="model.onnx", **kw) -> str:
    path = os.path.join(directory, name)
    onnx.save(model, path, **kw)
    return path


def onnxruntime_run(path: str, inputs: dict) -> list:
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, inputs)


def test_an_onnx_file_runs_as_a_graph_model_equal_to_onnxruntime(tmp_path):
    path = save(mlp(), tmp_path)
    model = Runtime("cpu").load(path)
    assert model.task == "graph"
    assert list(model.inputs) == ["x"] and model.inputs["x"].dtype == "f32"
    assert list(model.outputs) == ["y"]
    for batch in (1, 5):
        x = rng.standard_normal((batch, 6)).astype(np.float32)
        got = model.run({"x": x})["y"]
        np.testing.assert_allclose(got, onnxruntime_run(path, {"x": x})[0], rtol=1e-5, atol=1e-6)
    info = model.info()
    assert info["opsets"] == {"ai.onnx": 17} and info["onnx_ops"] == {"Add": 1, "MatMul": 2, "Relu": 1, "Softmax": 1}
    assert info["outputs"]["y"] == {"shape": ["batch", "4"], "dtype": "f32"}
    assert info["fusions"]                                # the bias and the activation folded into the matmul


def test_wrong_input_names_shapes_and_dtypes_are_request_errors(tmp_path):
    model = Runtime("cpu").load(save(mlp(), tmp_path))
    x = np.zeros((2, 6), np.float32)
    for bad, what in (({"z": x}, "missing x"), ({"x": x.astype(np.float64)}, "must be f32"),
                      ({"x": np.zeros((2, 7), np.float32)}, "must have shape"), ({"x": np.zeros(6, np.float32)}, "shape")):
        with pytest.raises(RequestError, match=what):
            model.run(bad)
    assert model.run({"x": x})["y"].shape == (2, 4)       # the model still serves


def test_an_axis_given_as_an_input_builds_a_graph_per_value(tmp_path):
    """ReduceSum's axes as a graph input (not a constant): each distinct value converts once."""
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    graph = helper.make_graph([node], "reduce", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
                                                 helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    graph.output[0].type.tensor_type.shape.dim.add().dim_param = "d0"
    graph.output[0].type.tensor_type.shape.dim.add().dim_param = "d1"
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path)
    model = Runtime("cpu").load(path)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    for axis in (0, 2, -2, 0):
        axes = np.array([axis], np.int64)
        np.testing.assert_allclose(model.run({"x": x, "axes": axes})["y"], onnxruntime_run(path, {"x": x, "axes": axes})[0],
                                   rtol=1e-6)
    assert len(model.runner.members) == 3


def test_external_data_loads_and_its_faults_name_the_file_and_tensor(tmp_path):
    path = save(mlp(hidden=64), tmp_path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
                size_threshold=0)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    np.testing.assert_allclose(Runtime("cpu").load(path).run({"x": x})["y"], onnxruntime_run(path, {"x": x})[0], rtol=1e-5)
    data = tmp_path / "weights.bin"
    blob = data.read_bytes()
    data.write_bytes(blob[:len(blob) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.onnx.*tensor '\w+'.*needs \d+ bytes.*weights\.bin"):
        Runtime("cpu").load(path)
    data.unlink()
    with pytest.raises(ModelLoadError, match=r"model\.onnx.*tensor '\w+'.*'weights\.bin' is missing"):
        Runtime("cpu").load(path)


def test_truncated_and_corrupt_files_are_load_errors_naming_the_file(tmp_path):
    whole = mlp().SerializeToString()
    truncated, corrupt = tmp_path / "truncated.onnx", tmp_path / "corrupt.onnx"
    truncated.write_bytes(whole[:len(whole) * 2 // 3])
    corrupt.write_bytes(bytes(rng.integers(0, 256, 4096, dtype=np.uint8)))
    for path in (truncated, corrupt):
        with pytest.raises(ModelLoadError, match=path.name):
            Runtime("cpu").load(str(path))


def test_an_unsupported_op_names_the_node_its_op_and_opset(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["h"], name="first"),
                               helper.make_node("Det", ["h"], ["y"], name="determinant")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"model\.onnx: node 'determinant' \(Det, opset 17\)"):
        Runtime("cpu").load(path)
    graph.node[1].domain, graph.node[1].op_type = "com.example", "Frobnicate"
    custom = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedModelError, match=r"node 'determinant' \(Frobnicate, opset 1\): op com\.example\.Frobnicate"):
        Runtime("cpu").load(save(custom, tmp_path, "custom.onnx"))


def test_an_input_declared_with_another_shape_than_its_initializer_is_a_load_error(tmp_path):
    lying_input = mlp(weight_shape=(6, 9))                 # W is declared [6, 8], its initializer is [6, 9]
    with pytest.raises(ModelLoadError, match=r"input 'W' is declared \[6, 8\] but its initializer is \[6, 9\]"):
        Runtime("cpu").load(save(lying_input, tmp_path, "input.onnx"))


def test_an_output_declared_with_another_shape_than_its_nodes_give_is_theirs_as_onnxruntime_takes_it(tmp_path, caplog):
    """A declared output shape is a hint in ONNX: onnxruntime runs such a file and warns; so do we, once."""
    path = save(mlp(declared_out=("batch", 5)), tmp_path)
    model = Runtime("cpu").load(path)
    for batch in (1, 3):
        x = rng.standard_normal((batch, 6)).astype(np.float32)
        got = model.run({"x": x})["y"]
        assert got.shape == (batch, 4)
        np.testing.assert_allclose(got, onnxruntime_run(path, {"x": x})[0], rtol=1e-5, atol=1e-6)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "output 'y'" in r.getMessage()]
    assert len(warnings) == 1 and "is declared [batch, 5], its nodes give [batch, 4]" in warnings[0]


def test_the_cli_runs_an_onnx_file_on_npy_and_npz_inputs_and_prints_its_info(tmp_path, capsys):
    path = save(mlp(), tmp_path)
    x = rng.standard_normal((2, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "inputs.npz", x=x)
    want = onnxruntime_run(path, {"x": x})[0]
    for spec in (f"x={tmp_path / 'x.npy'}", str(tmp_path / "inputs.npz")):
        out = tmp_path / "out"
        assert main(["run", "--model", path, "--input", spec, "--output-dir", str(out), "--backend", "cpu"]) == 0
        np.testing.assert_allclose(np.load(out / "y.npy"), want, rtol=1e-5, atol=1e-6)
    assert main(["models", "info", path]) == 0
    info = json.loads(capsys.readouterr().out.split("\n", 2)[-1])
    assert info["task"] == "graph" and info["opsets"] == {"ai.onnx": 17} and info["onnx_ops"]["MatMul"] == 2
    assert main(["run", "--model", path, "--prompt", "hello"]) != 0      # a graph takes arrays, not a prompt


def test_an_output_that_is_a_symbolic_size_is_computed_per_shape(tmp_path):
    graph = helper.make_graph([helper.make_node("Shape", ["x"], ["s"])], "shape",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                              [helper.make_tensor_value_info("s", TensorProto.INT64, [2])])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path)
    model = Runtime("cpu").load(path)
    for n in (5, 2):
        x = np.zeros((n, 3), np.float32)
        np.testing.assert_array_equal(model.run({"x": x})["s"], onnxruntime_run(path, {"x": x})[0])


def test_sizes_the_data_decides_are_bound_as_the_graph_runs(tmp_path):
    """A TopK whose k is counted from the data; the positive entries gathered by NonZero and written back
    doubled by ScatterND (a spline flow's masked update), and padded by their own count: one graph, equal
    to onnxruntime for any data."""
    nodes = [helper.make_node("Greater", ["x", "zero"], ["positive"]),
             helper.make_node("Cast", ["positive"], ["ones"], to=TensorProto.INT64),
             helper.make_node("ReduceSum", ["ones"], ["count"], keepdims=1),
             helper.make_node("Reshape", ["count", "flat"], ["k"]),
             helper.make_node("Reshape", ["x", "flat"], ["row"]),
             helper.make_node("TopK", ["row", "k"], ["top", "where"], axis=-1),
             helper.make_node("NonZero", ["positive"], ["at"]),
             helper.make_node("Transpose", ["at"], ["tuples"], perm=[1, 0]),
             helper.make_node("GatherND", ["x", "tuples"], ["picked"]),
             helper.make_node("Add", ["picked", "picked"], ["doubled"]),
             helper.make_node("ScatterND", ["x", "tuples", "doubled"], ["y"]),
             helper.make_node("Shape", ["picked"], ["many"]),
             helper.make_node("Concat", ["one", "many"], ["pads"], axis=0),
             helper.make_node("Pad", ["picked", "pads"], ["padded"])]
    graph = helper.make_graph(nodes, "masked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info(name, dt, None) for name, dt in
                               (("top", TensorProto.FLOAT), ("where", TensorProto.INT64), ("y", TensorProto.FLOAT),
                                ("padded", TensorProto.FLOAT))],
                              [numpy_helper.from_array(np.array(0, np.float32), "zero"),
                               numpy_helper.from_array(np.array([-1], np.int64), "flat"),
                               numpy_helper.from_array(np.array([1], np.int64), "one")])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path)
    model = Runtime("cpu").load(path)
    counts = set()
    for seed in range(4):
        x = np.random.default_rng(seed).standard_normal((3, 4)).astype(np.float32)
        got, want = model.run({"x": x}), onnxruntime_run(path, {"x": x})
        for name, expected in zip(("top", "where", "y", "padded"), want):
            np.testing.assert_array_equal(got[name], expected)
        counts.add(len(want[0]))
    assert len(counts) > 1                               # the data did decide the sizes


@pytest.mark.parametrize("centered", [0, 1])
def test_non_max_suppression_keeps_what_onnxruntime_keeps(tmp_path, centered):
    """Random overlapping boxes, two batches of three classes: the same boxes kept, in the same order."""
    node = helper.make_node("NonMaxSuppression", ["boxes", "scores", "most", "iou", "floor"], ["kept"],
                            center_point_box=centered)
    graph = helper.make_graph([node], "nms", [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [2, 40, 4]),
                                              helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 3, 40])],
                              [helper.make_tensor_value_info("kept", TensorProto.INT64, None)],
                              [numpy_helper.from_array(np.array([7], np.int64), "most"),
                               numpy_helper.from_array(np.array([0.4], np.float32), "iou"),
                               numpy_helper.from_array(np.array([0.2], np.float32), "floor")])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path)
    model = Runtime("cpu").load(path)
    generator = np.random.default_rng(3)
    for _ in range(3):
        corner = generator.uniform(0, 10, (2, 40, 2))
        boxes = np.concatenate([corner, corner + generator.uniform(0.5, 4, (2, 40, 2))], axis=-1).astype(np.float32)
        scores = generator.uniform(0, 1, (2, 3, 40)).astype(np.float32)
        feed = {"boxes": boxes, "scores": scores}
        np.testing.assert_array_equal(model.run(feed)["kept"], onnxruntime_run(path, feed)[0])

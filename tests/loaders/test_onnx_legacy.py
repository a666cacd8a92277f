"""Older and rarer ONNX graphs against onnxruntime in the same run: ops written at the opsets the classic
model zoos use (1-9, with their legacy attributes), sequence ops as torch exports of lists write them, and
string tensors moved unchanged or normalized. What the importer does not take is an UnsupportedModelError
naming the node, its op and its opset."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from soma_runtime.backends import get
from soma_runtime.engine.graph import graph_runner
from soma_runtime.errors import ModelLoadError, UnsupportedModelError
from soma_runtime.loaders.onnx import onnx_graph

ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(4)           # "only guarantees opset 7 and above", per model
rng = np.random.default_rng(0)
ELEMENT = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
           np.dtype(np.int32): TensorProto.INT32, np.dtype(object): TensorProto.STRING, np.dtype(np.bool_): TensorProto.BOOL}


def model(nodes, inputs: dict, opset: int, outputs=("y",), constants: dict | None = None) -> onnx.ModelProto:
    """A graph of `nodes` at `opset`: `inputs` are its graph inputs (their arrays give types and shapes),
    `constants` its initializers; outputs left undeclared but for their types, as old exporters left them."""
    graph = helper.make_graph(
        nodes, "legacy", [helper.make_tensor_value_info(k, ELEMENT[v.dtype], v.shape) for k, v in inputs.items()],
        [helper.make_value_info(name, onnx.TypeProto()) for name in outputs],
        [numpy_helper.from_array(v, k) for k, v in (constants or {}).items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 7 if opset < 21 else m.ir_version
    return m


def ours(m: onnx.ModelProto, inputs: dict) -> list[np.ndarray]:
    runner = graph_runner(onnx_graph(m, ".", "legacy.onnx"), get("cpu"))
    got = runner.run(inputs)
    return [got[o.name] for o in m.graph.output]


def theirs(m: onnx.ModelProto, inputs: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


def assert_agrees(m: onnx.ModelProto, inputs: dict) -> None:
    for got, want in zip(ours(m, inputs), theirs(m, inputs), strict=True):
        assert got.shape == want.shape
        if want.dtype == object:
            assert got.tolist() == want.tolist()
        else:
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def x(*shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def i64(*values) -> np.ndarray:
    return np.array(values[0] if len(values) == 1 else values, np.int64)


def node(op: str, inputs, outputs=("y",), **attrs) -> onnx.NodeProto:
    return helper.make_node(op, list(inputs), list(outputs), name=f"{op.lower()}_{outputs[0]}", **attrs)


X = x(2, 3, 4, 5)
C = np.abs(x(3)) + 0.5
LEGACY = {      # id: (opset, nodes, inputs, initializers)
    "relu-6": (6, [node("Relu", ["x"])], {"x": X}, {}),
    "sigmoid-6": (6, [node("Sigmoid", ["x"])], {"x": X}, {}),
    "leaky_relu-6": (6, [node("LeakyRelu", ["x"], alpha=0.2)], {"x": X}, {}),
    "elu-6": (6, [node("Elu", ["x"], alpha=0.5)], {"x": X}, {}),
    "hard_sigmoid-6": (6, [node("HardSigmoid", ["x"], alpha=0.3)], {"x": X}, {}),
    "clip-6 by attributes": (6, [node("Clip", ["x"], min=-0.5, max=0.25)], {"x": X}, {}),
    "clip-6 with no bounds": (6, [node("Clip", ["x"])], {"x": X}, {}),
    "cast-6": (6, [node("Cast", ["x"], to=TensorProto.INT32)], {"x": X * 4}, {}),
    "softmax-1 coerced to 2-D": (1, [node("Softmax", ["x"])], {"x": X}, {}),
    "softmax-1 at axis 2": (1, [node("Softmax", ["x"], axis=2)], {"x": X}, {}),
    "log_softmax-1 at axis 0": (1, [node("LogSoftmax", ["x"], axis=0)], {"x": X}, {}),
    "softmax-11 at axis -1": (11, [node("Softmax", ["x"], axis=-1)], {"x": X}, {}),
    "hardmax-1": (1, [node("Hardmax", ["x"])], {"x": X}, {}),
    "concat-4": (4, [node("Concat", ["x", "x"], axis=1)], {"x": X}, {}),
    "reshape-1 by attribute": (1, [node("Reshape", ["x"], shape=[2, 0, -1])], {"x": X}, {}),
    "reshape-1 with consumed_inputs": (1, [node("Reshape", ["x"], shape=[6, 20], consumed_inputs=[0])], {"x": X}, {}),
    "slice-1 by attributes": (1, [node("Slice", ["x"], starts=[1, -3], ends=[3, 1000], axes=[1, 3])], {"x": X}, {}),
    "slice-1 without axes": (1, [node("Slice", ["x"], starts=[1, 0], ends=[2, -1])], {"x": X}, {}),
    "split-2 by attribute": (2, [node("Split", ["x"], ["a", "b"], axis=3, split=[2, 3])], {"x": X}, {}),
    "split-2 into equal parts": (2, [node("Split", ["x"], ["a", "b"], axis=0)], {"x": X}, {}),
    "squeeze-1 by attribute": (1, [node("Squeeze", ["x"], axes=[0, 2])], {"x": x(1, 3, 1, 5)}, {}),
    "squeeze-1 without axes": (1, [node("Squeeze", ["x"])], {"x": x(1, 3, 1, 5)}, {}),
    "unsqueeze-1 by attribute": (1, [node("Unsqueeze", ["x"], axes=[0, 3])], {"x": x(3, 5)}, {}),
    "reduce_sum-1 by attribute": (1, [node("ReduceSum", ["x"], axes=[1, 3], keepdims=0)], {"x": X}, {}),
    "reduce_mean-1 over all": (1, [node("ReduceMean", ["x"])], {"x": X}, {}),
    "reduce_max-1 by attribute": (1, [node("ReduceMax", ["x"], axes=[-1])], {"x": X}, {}),
    "sum-6": (6, [node("Sum", ["x", "x", "x"])], {"x": X}, {}),
    "max-6": (6, [node("Max", ["x", "w"])], {"x": X}, {"w": x(2, 3, 4, 5)}),
    "mean-6": (6, [node("Mean", ["x", "w"])], {"x": X}, {"w": x(2, 3, 4, 5)}),
    "pad-2 by attribute": (2, [node("Pad", ["x"], pads=[0, 1, 0, 2, 0, 0, 1, 1], value=1.5)], {"x": X}, {}),
    "pad-2 reflect": (2, [node("Pad", ["x"], pads=[0, 0, 1, 2, 0, 0, 2, 1], mode="reflect")], {"x": X}, {}),
    "conv-1": (1, [node("Conv", ["x", "w"], strides=[2, 1], pads=[1, 0, 1, 0])], {"x": X}, {"w": x(4, 3, 3, 2)}),
    "max_pool-1": (1, [node("MaxPool", ["x"], kernel_shape=[2, 2], strides=[2, 2])], {"x": X}, {}),
    "average_pool-7": (7, [node("AveragePool", ["x"], kernel_shape=[2, 3], pads=[1, 1, 1, 1], count_include_pad=1)],
                       {"x": X}, {}),
    "global_average_pool-1": (1, [node("GlobalAveragePool", ["x"])], {"x": X}, {}),
    "flatten-1": (1, [node("Flatten", ["x"], axis=2)], {"x": X}, {}),
    "transpose-1": (1, [node("Transpose", ["x"], perm=[0, 2, 3, 1])], {"x": X}, {}),
    "matmul-1": (1, [node("MatMul", ["x", "w"])], {"x": X}, {"w": x(5, 2)}),
    "lrn-1": (1, [node("LRN", ["x"], size=3, alpha=1e-3)], {"x": X}, {}),
    "instance_norm-6": (6, [node("InstanceNormalization", ["x", "s", "b"], epsilon=1e-3)], {"x": X}, {"s": C, "b": x(3)}),
    "batch_norm-7 spatial": (7, [node("BatchNormalization", ["x", "s", "b", "m", "v"], spatial=1)], {"x": X},
                             {"s": C, "b": x(3), "m": x(3), "v": C}),
    "batch_norm-9": (9, [node("BatchNormalization", ["x", "s", "b", "m", "v"], epsilon=1e-3)], {"x": X},
                     {"s": C, "b": x(3), "m": x(3), "v": C}),
    "batch_norm-7 per activation": (7, [node("BatchNormalization", ["x", "s", "b", "m", "v"], spatial=0)], {"x": X},
                                    {"s": np.abs(x(3, 4, 5)), "b": x(3, 4, 5), "m": x(3, 4, 5), "v": np.abs(x(3, 4, 5))}),
    "dropout-10": (10, [node("Dropout", ["x"], ratio=0.3)], {"x": X}, {}),
    "gemm-7 with a row bias": (7, [node("Gemm", ["a", "w", "c"], transB=1, alpha=0.5, beta=2.0)], {"a": x(2, 3)},
                               {"w": x(4, 3), "c": x(4)}),
    "gemm-9 transposed a": (9, [node("Gemm", ["a", "w", "c"], transA=1)], {"a": x(3, 2)}, {"w": x(3, 4), "c": x(2, 1)}),
    "upsample-7 nearest": (7, [node("Upsample", ["x"], scales=[1.0, 1.0, 2.0, 3.0])], {"x": X}, {}),
    "upsample-7 linear": (7, [node("Upsample", ["x"], scales=[1.0, 1.0, 2.0, 2.0], mode="linear")], {"x": X}, {}),
    "upsample-9 by input": (9, [node("Upsample", ["x", "s"], mode="nearest")], {"x": X},
                            {"s": np.array([1, 1, 2, 2], np.float32)}),
    "tile-6": (6, [node("Tile", ["x", "r"])], {"x": X}, {"r": np.array([1, 2, 1, 2], np.int64)}),
    "gather-1": (1, [node("Gather", ["x", "i"], axis=1)], {"x": X}, {"i": np.array([[2, 0], [1, 1]], np.int64)}),
    "arg_max-1": (1, [node("ArgMax", ["x"], axis=2, keepdims=0)], {"x": X}, {}),
    "top_k-1": (1, [node("TopK", ["x"], ["v", "i"], k=2, axis=1)], {"x": X}, {}),
    "prelu-7": (7, [node("PRelu", ["x", "s"])], {"x": X}, {"s": x(3, 1, 1)}),
    "constant-1": (1, [node("Constant", [], ["c"], value=numpy_helper.from_array(x(5, 2))), node("MatMul", ["x", "c"])],
                   {"x": X}, {}),
    "image_scaler (experimental)": (7, [node("ImageScaler", ["x"], scale=0.5, bias=[1.0, -2.0, 3.0])], {"x": X}, {}),
    "crop (experimental)": (7, [node("Crop", ["x"], border=[1, 0, 2, 1])], {"x": x(2, 3, 6, 7)}, {}),
    "crop to a size (experimental)": (7, [node("Crop", ["x"], border=[1, 2, 0, 0], scale=[3, 4])], {"x": x(2, 3, 6, 7)},
                                      {}),
    "mean_variance_normalization (experimental)": (7, [node("MeanVarianceNormalization", ["x"])], {"x": X}, {}),
    "mean_variance_normalization across channels, not divided (experimental)": (
        7, [node("MeanVarianceNormalization", ["x"], across_channels=1, normalize_variance=0)], {"x": X}, {}),
    "mean_variance_normalization-9": (9, [node("MeanVarianceNormalization", ["x"], axes=[1, 3])], {"x": X}, {}),
    "thresholded_relu (experimental)": (7, [node("ThresholdedRelu", ["x"], alpha=0.5)], {"x": X}, {}),
    "dynamic_slice (experimental)": (7, [node("DynamicSlice", ["x", "s", "e", "a"])], {"x": X},
                                     {"s": i64(1, -3), "e": i64(3, 1000), "a": i64(1, 3)}),
    "scale (experimental)": (7, [node("Scale", ["x"], scale=3.0)], {"x": X}, {}),
    "affine (experimental)": (7, [node("Affine", ["x"], alpha=2.0, beta=-1.0)], {"x": X}, {}),
    "scaled_tanh (experimental)": (7, [node("ScaledTanh", ["x"], alpha=2.0, beta=0.5)], {"x": X}, {}),
    "parametric_softplus (experimental)": (7, [node("ParametricSoftplus", ["x"], alpha=2.0, beta=0.5)], {"x": X}, {}),
}


@pytest.mark.parametrize("case", LEGACY)
def test_an_op_at_an_old_opset_agrees_with_onnxruntime(case):
    opset, nodes, inputs, constants = LEGACY[case]
    outputs = [o for o in nodes[-1].output]
    assert_agrees(model(nodes, inputs, opset, outputs, constants), inputs)


def test_dropout_before_opset_12_passes_its_input_and_keeps_every_element():
    """The output agrees with onnxruntime; the mask (x's type before opset 10, bool after) is all kept, as
    opset 12 and ONNX's reference define it (onnxruntime writes zeros for these opsets)."""
    for opset, mask_type in ((6, np.float32), (7, np.float32), (10, np.bool_)):
        m = model([node("Dropout", ["x"], ["y", "mask"], ratio=0.3)], {"x": X}, opset, ["y", "mask"])
        y, mask = ours(m, {"x": X})
        if opset >= 7:
            np.testing.assert_array_equal(y, theirs(m, {"x": X})[0])
        np.testing.assert_array_equal(y, X)
        assert mask.dtype == mask_type and mask.shape == X.shape and mask.all()


B3 = x(3)
BEFORE_7 = {    # forms onnxruntime no longer runs (it has no kernel before opset 7): numpy, written out, is the reference
    "add-6 broadcast from axis 1": (6, node("Add", ["x", "b"], broadcast=1, axis=1), {"b": B3},
                                    X + B3.reshape(3, 1, 1)),
    "mul-1 broadcast over the last dims": (1, node("Mul", ["x", "b"], broadcast=1, consumed_inputs=[0]),
                                           {"b": X[0, 0]}, X * X[0, 0]),
    "sub-6 of equal shapes": (6, node("Sub", ["x", "b"]), {"b": X[::-1].copy()}, X - X[::-1]),
    "greater-1 broadcast from axis 1": (1, node("Greater", ["x", "b"], broadcast=1, axis=1), {"b": X[0, :, :, 0]},
                                        X > X[0, :, :, :1]),
    "concat-1 along its default axis 1": (1, node("Concat", ["x", "b"]), {"b": X}, np.concatenate([X, X], 1)),
    "tile-1 along one axis": (1, node("Tile", ["x", "t", "a"]), {"t": np.array(3, np.int64), "a": np.array(2, np.int64)},
                              np.tile(X, (1, 1, 3, 1))),
    "cast-1 by type name": (1, node("Cast", ["x"], to="INT32"), {}, X.astype(np.int32)),
    "pad-1 by paddings": (1, node("Pad", ["x"], paddings=[0, 0, 1, 2, 0, 0, 2, 1], value=1.5), {},
                          np.pad(X, ((0, 0), (0, 0), (1, 2), (2, 1)), constant_values=1.5)),
    "pad-1 edge": (1, node("Pad", ["x"], paddings=[0, 1, 0, 2, 0, 0, 3, 0], mode="edge"), {},
                   np.pad(X, ((0, 0), (1, 0), (0, 3), (2, 0)), mode="edge")),
    "batch_norm-1 with consumed_inputs": (1, node("BatchNormalization", ["x", "s", "b", "m", "v"], is_test=1,
                                                  consumed_inputs=[0, 0, 0, 1, 1]), {"s": C, "b": B3, "m": B3, "v": C},
                                          (X - B3.reshape(3, 1, 1)) / np.sqrt(C.reshape(3, 1, 1) + 1e-5) * C.reshape(3, 1, 1)
                                          + B3.reshape(3, 1, 1)),
    "batch_norm-6 in test mode": (6, node("BatchNormalization", ["x", "s", "b", "m", "v"], is_test=1, epsilon=1e-3),
                                  {"s": C, "b": B3, "m": B3, "v": C},
                                  (X - B3.reshape(3, 1, 1)) / np.sqrt(C.reshape(3, 1, 1) + 1e-3) * C.reshape(3, 1, 1)
                                  + B3.reshape(3, 1, 1)),
}


@pytest.mark.parametrize("case", BEFORE_7)
def test_an_op_onnxruntime_runs_only_from_opset_7_computes_its_older_form(case):
    opset, op, constants, want = BEFORE_7[case]
    got, = ours(model([op], {"x": X}, opset, constants=constants), {"x": X})
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def running_sum_body() -> onnx.GraphProto:
    """One step of a scan: the state plus this step's slice of a, times b's; the new state is the output too."""
    values = {name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("s", "a", "b", "s2", "out")}
    steps = [node("Mul", ["a", "b"], ["ab"]), node("Add", ["s", "ab"], ["s2"]), node("Identity", ["s2"], ["out"])]
    return helper.make_graph(steps, "step", [values["s"], values["a"], values["b"]], [values["s2"], values["out"]])


@pytest.mark.parametrize("directions, lengths", [([0, 0], None), ([1, 0], None), ([0, 1], [3, 3])])
def test_scan_8_over_a_batch_agrees_with_onnxruntime(directions, lengths):
    inputs = {"s": x(2, 4), "a": x(2, 3, 4), "b": x(2, 3, 4)}
    constants = {} if lengths is None else {"lengths": np.array(lengths, np.int64)}
    scan = helper.make_node("Scan", ["lengths" if lengths else "", "s", "a", "b"], ["final", "y"], name="scan",
                            body=running_sum_body(), num_scan_inputs=2, directions=directions)
    assert_agrees(model([scan], inputs, 8, ["final", "y"], constants), inputs)


def test_split_1_takes_its_sizes_as_an_input():
    m = model([node("Split", ["x", "s"], ["a", "b"], axis=3)], {"x": X}, 1, ["a", "b"], {"s": np.array([1, 4], np.int64)})
    a, b = ours(m, {"x": X})
    np.testing.assert_array_equal(a, X[..., :1])
    np.testing.assert_array_equal(b, X[..., 1:])


@pytest.mark.parametrize("op, opset, error, why", [
    (node("Upsample", ["x"], height_scale=2.0, width_scale=2.0), 1, UnsupportedModelError,
     r"\(Upsample, opset 1\): the experimental Upsample"),
    (node("Add", ["x", "b"], broadcast=1, axis=2), 6, UnsupportedModelError, r"\(Add, opset 6\): .*do not broadcast"),
    (node("Add", ["x", "b"]), 6, ModelLoadError, r"\(Add, opset 6\): shapes .* differ and `broadcast` is not set"),
])
def test_an_old_form_the_importer_cannot_take_names_node_op_and_opset(op, opset, error, why):
    with pytest.raises(error, match=why):
        onnx_graph(model([op], {"x": X}, opset, constants={"b": B3}), ".", "legacy.onnx")


# --- sequences ------------------------------------------------------------------------------------

SEQUENCES = {   # id: (nodes, outputs, initializers); x is [2, 6, 4]
    "split into ones, at and length": (
        [node("SplitToSequence", ["x"], ["s"], axis=1, keepdims=0), node("SequenceAt", ["s", "minus1"], ["last"]),
         node("SequenceLength", ["s"], ["n"]), node("ConcatFromSequence", ["s"], ["y"], axis=-1, new_axis=1)],
        ["last", "n", "y"], {"minus1": i64(-1)}),
    "split by a chunk size, the last one shorter": (
        [node("SplitToSequence", ["x", "four"], ["s"], axis=1), node("SequenceAt", ["s", "one"], ["tail"]),
         node("ConcatFromSequence", ["s"], ["y"], axis=1)], ["tail", "y"], {"four": i64(4), "one": i64(1)}),
    "split by sizes, reordered": (
        [node("SplitToSequence", ["x", "sizes"], ["s"], axis=2), node("SequenceAt", ["s", "one"], ["b"]),
         node("SequenceAt", ["s", "zero"], ["a"]), node("SequenceConstruct", ["b", "a", "b"], ["t"]),
         node("ConcatFromSequence", ["t"], ["y"], axis=2)], ["y"],
        {"sizes": i64(1, 3), "one": i64(1), "zero": i64(0)}),
    "construct, insert, erase": (
        [node("Relu", ["x"], ["r"]), node("SequenceConstruct", ["x", "r"], ["s"]),
         node("SequenceInsert", ["s", "x", "one"], ["t"]), node("SequenceErase", ["t", "zero"], ["u"]),
         node("SequenceErase", ["u"], ["v"]), node("SequenceInsert", ["v", "r"], ["w"]),
         node("ConcatFromSequence", ["w"], ["y"], axis=0, new_axis=1), node("SequenceLength", ["w"], ["n"])],
        ["y", "n"], {"one": i64(1), "zero": i64(0)}),
    "empty, then appended to": (
        [helper.make_node("SequenceEmpty", [], ["e"], dtype=TensorProto.FLOAT), node("SequenceInsert", ["e", "x"], ["s"]),
         node("Neg", ["x"], ["m"]), node("SequenceInsert", ["s", "m", "zero"], ["t"]),
         node("ConcatFromSequence", ["t"], ["y"], axis=1)], ["y"], {"zero": i64(0)}),
}


@pytest.mark.parametrize("case", SEQUENCES)
def test_a_sequence_whose_positions_the_graph_settles_agrees_with_onnxruntime(case):
    nodes, outputs, constants = SEQUENCES[case]
    inputs = {"x": x(2, 6, 4)}
    assert_agrees(model(nodes, inputs, 17, outputs, constants), inputs)


def test_a_torchscript_export_of_a_list_agrees_with_onnxruntime_at_two_sizes(tmp_path):
    """A list built and indexed in script: TorchScript's exporter writes SplitToSequence, a Loop appending to a
    SequenceEmpty, ConcatFromSequence and SequenceAt for it."""
    torch = pytest.importorskip("torch")

    class Pieces(torch.nn.Module):
        def forward(self, x):
            parts = torch.split(x, 2, dim=1)
            scaled = [p * (i + 1) for i, p in enumerate(parts)]
            return torch.cat(scaled, dim=1), torch.stack([parts[0], parts[-1]], 0)

    path = str(tmp_path / "pieces.onnx")
    torch.onnx.export(torch.jit.script(Pieces()), (torch.randn(3, 6, 4),), path, dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["cat", "stack"], dynamic_axes={"x": {0: "batch"}})
    m = onnx.load(path)
    assert {"SplitToSequence", "SequenceEmpty", "ConcatFromSequence", "SequenceAt"} <= {n.op_type for n in m.graph.node}
    for batch in (1, 5):
        inputs = {"x": x(batch, 6, 4)}
        assert_agrees(m, inputs)


def test_a_split_only_the_data_decides_names_node_op_and_opset():
    nodes = [node("ReduceMax", ["x"], ["top"], keepdims=0), node("Cast", ["top"], ["k"], to=TensorProto.INT64),
             helper.make_node("SplitToSequence", ["x", "k"], ["s"], name="pieces", axis=1),
             node("ConcatFromSequence", ["s"], ["y"], axis=1)]
    inputs = {"x": np.full((2, 6), 3, np.float32)}
    with pytest.raises(UnsupportedModelError, match=r"node 'pieces' \(SplitToSequence, opset 17\): its split is computed"):
        ours(model(nodes, inputs, 17), inputs)


def test_a_sequence_as_an_output_or_given_to_an_op_that_takes_tensors_is_refused_by_name():
    inputs = {"x": x(2, 3)}
    as_output = model([node("SequenceConstruct", ["x", "x"], ["y"])], inputs, 17)
    with pytest.raises(UnsupportedModelError, match=r"output 'y' is a sequence \(of 2 tensors\)"):
        onnx_graph(as_output, ".", "legacy.onnx")
    mapped = model([node("SequenceConstruct", ["x", "x"], ["s"]),
                    helper.make_node("SequenceMap", ["s"], ["t"], name="map", body=helper.make_graph(
                        [node("Relu", ["a"], ["b"])], "body", [helper.make_tensor_value_info("a", TensorProto.FLOAT, None)],
                        [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])),
                    node("ConcatFromSequence", ["t"], ["y"], axis=0)], inputs, 17)
    with pytest.raises(UnsupportedModelError, match=r"node 'map' \(SequenceMap, opset 17\): input 's' is a sequence"):
        onnx_graph(mapped, ".", "legacy.onnx")


# --- strings: settled at import (the IR has no string dtype) ---------------------------------------

WORDS = np.array(["Monday", "the", "ÉTÉ", "Straße", "İstanbul", "and", "ΣΑΣ"], dtype=object)


def strings(name: str, values) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.STRING, np.shape(values), [v.encode() for v in np.ravel(values)])


def normalizer(inputs, output, **attrs) -> onnx.NodeProto:
    """onnxruntime's default locale (en_US.UTF-8) is not installed on every machine: C.UTF-8 cases alike."""
    return helper.make_node("StringNormalizer", inputs, [output], name=f"normalize_{output}", locale="C.UTF-8", **attrs)


STRING_GRAPHS = {   # id: (nodes, initializers); the graph's output y = where(mask, x, -x), mask from strings
    "moved, then compared": (
        [node("Gather", ["words", "picks"], ["picked"]), node("Unsqueeze", ["picked", "zero"], ["row"]),
         node("Concat", ["row", "row"], ["two"], axis=0), node("Reshape", ["two", "flat"], ["all"]),
         node("Slice", ["all", "one", "five"], ["some"]), node("Identity", ["some"], ["same"]),
         node("Equal", ["same", "want"], ["mask"]), node("Where", ["mask", "x", "minus_x"])],
        {"picks": i64(4, 0, 2, 4), "zero": i64(0).reshape(1), "flat": i64(-1).reshape(1), "one": i64(1).reshape(1),
         "five": i64(5).reshape(1), "want": np.array(["Monday", "ÉTÉ", "İstanbul", "İstanbul"], dtype=object)}),
    "transposed, split, tiled, expanded": (
        [node("Slice", ["words", "zero", "six"], ["six_words"]), node("Reshape", ["six_words", "two_by_three"], ["grid"]),
         node("Transpose", ["grid"], ["turned"], perm=[1, 0]), node("Split", ["turned", "sizes"], ["top", "rest"], axis=0),
         node("Tile", ["top", "twice"], ["tiled"]), node("Expand", ["tiled", "wide"], ["wider"]),
         node("Reshape", ["wider", "flat"], ["flat_words"]), node("Equal", ["flat_words", "want"], ["mask"]),
         node("Where", ["mask", "x", "minus_x"])],
        {"zero": i64(0).reshape(1), "six": i64(6).reshape(1), "two_by_three": i64(2, 3), "sizes": i64(1, 2),
         "twice": i64(1, 2), "wide": i64(2, 1), "flat": i64(-1).reshape(1),
         "want": np.array(["Monday", "Straße", "Monday", "x", "Monday", "Straße", "Monday", "Straße"], dtype=object)}),
    "lowered less stopwords": (
        [normalizer(["words"], "clean", case_change_action="LOWER", stopwords=["THE", "and"]),
         node("Equal", ["clean", "want"], ["mask"]), node("Where", ["mask", "x", "minus_x"])],
        {"want": np.array(["monday", "x", "straße", "istanbul", "σασ"], dtype=object)}),
    "uppered, case-sensitive stopwords, [1, C]": (
        [node("Unsqueeze", ["words", "zero"], ["row"]),
         normalizer(["row"], "clean", case_change_action="UPPER", is_case_sensitive=1, stopwords=["the", "AND"]),
         node("Squeeze", ["clean", "zero"], ["flat"]), node("Equal", ["flat", "want"], ["mask"]),
         node("Where", ["mask", "x", "minus_x"])],
        {"zero": i64(0).reshape(1), "want": np.array(["MONDAY", "ÉTÉ", "STRAßE", "x", "AND", "ΣΑΣ"], dtype=object)}),
    "all stopwords: one empty string": (
        [node("Slice", ["words", "one", "two"], ["the"]), normalizer(["the"], "clean", stopwords=["The"]),
         node("Shape", ["clean"], ["n"]), node("Equal", ["clean", "empty"], ["hit"]), node("Cast", ["n"], ["size"], to=1),
         node("Where", ["hit", "x", "size"], ["z"]), node("Mul", ["z", "minus_x"])],
        {"one": i64(1).reshape(1), "two": i64(2).reshape(1), "empty": np.array([""], dtype=object)}),
}


@pytest.mark.parametrize("case", STRING_GRAPHS)
def test_string_constants_moved_and_normalized_at_import_agree_with_onnxruntime(case):
    nodes, constants = STRING_GRAPHS[case]
    inputs = {"x": x(len(constants["want"]) if "want" in constants else 1)}
    m = model([node("Neg", ["x"], ["minus_x"]), *nodes], inputs, 19)          # Equal takes strings from opset 19
    for name, value in {"words": WORDS, **constants}.items():
        m.graph.initializer.append(strings(name, value) if value.dtype == object else numpy_helper.from_array(value, name))
    assert_agrees(m, inputs)


def test_strings_the_graph_cannot_settle_at_import_are_refused_by_name():
    text = {"t": np.array(["a", "b"], dtype=object)}
    with pytest.raises(UnsupportedModelError, match=r"input 't': element type STRING is not supported"):
        onnx_graph(model([node("Identity", ["t"])], text, 17), ".", "legacy.onnx")
    m = model([node("Gather", ["words", "i"], ["y"])], {"i": i64(0, 1)}, 17)
    m.graph.initializer.append(strings("words", WORDS))
    with pytest.raises(UnsupportedModelError, match=r"node 'gather_y' \(Gather, opset 17\): string tensors reach take"):
        onnx_graph(m, ".", "legacy.onnx")
    m = model([normalizer(["words"], "y", case_change_action="LOWER")], {}, 17)
    m.graph.initializer.append(strings("words", WORDS))
    with pytest.raises(UnsupportedModelError, match=r"output 'y' holds strings"):
        onnx_graph(m, ".", "legacy.onnx")
    m = model([helper.make_node("StringNormalizer", ["words"], ["y"], name="tr", locale="tr_TR.UTF-8")], {}, 17)
    m.graph.initializer.append(strings("words", WORDS))
    with pytest.raises(UnsupportedModelError, match=r"node 'tr' \(StringNormalizer, opset 17\): locale 'tr_TR.UTF-8'"):
        onnx_graph(m, ".", "legacy.onnx")


def test_scan_8_over_sequences_shorter_than_their_batch_is_refused_by_name():
    inputs = {"s": x(2, 4), "a": x(2, 3, 4), "b": x(2, 3, 4)}
    scan = helper.make_node("Scan", ["lengths", "s", "a", "b"], ["final", "y"], name="scan", body=running_sum_body(),
                            num_scan_inputs=2)
    m = model([scan], inputs, 8, ["final", "y"], {"lengths": i64(3, 2)})
    with pytest.raises(UnsupportedModelError, match=r"node 'scan' \(Scan, opset 8\): sequence lengths \[3, 2\]"):
        onnx_graph(m, ".", "legacy.onnx")

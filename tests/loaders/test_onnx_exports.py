"""Real exports whose sizes follow from their inputs' shapes (issue 53, item 1): torch's TorchScript exporter
with dynamic batch and image axes, and the shape subgraphs other exporters write (sentinel slice ends,
`-1`/`_` dims, shapes computed then used), each run at two or more input sizes against onnxruntime."""
from __future__ import annotations

import importlib.util
import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from soma_runtime.backends import get
from soma_runtime.engine.graph import MEMBERS_KEPT, graph_runner
from soma_runtime.errors import UnsupportedModelError
from soma_runtime.loaders.onnx import load_onnx

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
nn, F = torch.nn, torch.nn.functional
INT64_MAX, INT32_MAX, TF_END = 2**63 - 1, 2**31 - 1, 1_000_000_000


def agrees_with_onnxruntime(path: str, feeds: list[dict]) -> None:
    ours = graph_runner(load_onnx(path).graph, get("cpu"))
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for feed in feeds:
        got = ours.run(feed)
        for name, want in zip(names, session.run(None, feed)):
            assert got[name].shape == want.shape, (name, {k: v.shape for k, v in feed.items()})
            np.testing.assert_allclose(got[name], want, rtol=1e-3, atol=1e-5)


def exported(tmp_path, module: nn.Module, channels: int, outputs: int = 1) -> str:
    """`module` exported by TorchScript with batch, height and width dynamic (as detectors and OCR models are)."""
    torch.manual_seed(0)
    module = module.eval()
    for p in module.parameters():
        p.data.normal_(0, 0.3)
    path = str(tmp_path / "model.onnx")
    names = [f"out{i}" for i in range(outputs)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(1, channels, 16, 20),), path, input_names=["x"], output_names=names,
                          dynamic_axes={"x": {0: "batch", 2: "height", 3: "width"}, **{n: {0: "batch"} for n in names}},
                          opset_version=17, dynamo=False)
    return path


def images(channels: int, *sizes) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((b, channels, h, w)).astype(np.float32)} for b, h, w in sizes]


class SizedByInput(nn.Module):
    """Upsampled to sizes computed from x.shape, by a scale, flattened to (x.shape[0], -1)."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        h, w = x.shape[2], x.shape[3]
        y = F.relu(self.conv(x))
        y = F.interpolate(y, size=(h * 2, w * 2), mode="nearest")
        y = F.interpolate(F.max_pool2d(y, 2), scale_factor=2.0, mode="bilinear", align_corners=False)
        y = self.head(y)
        return y.reshape(x.shape[0], -1).mean(1, keepdim=True) + torch.flatten(y, 1)[:, :1]


class ScaledOnly(nn.Module):
    """Resized by constant scales only: the input to Resize has the sizes a strided conv gives."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)

    def forward(self, x):
        y = F.interpolate(self.conv(x), scale_factor=2.0, mode="bilinear", align_corners=False)
        return F.interpolate(y, scale_factor=(0.5, 1.5), mode="nearest").sum((2, 3))


class Recognizer(nn.Module):
    """A CRNN text recognizer: two strided convs, then an LSTM over (((width-1)//2)//2)+1 columns."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.lstm, self.fc = nn.LSTM(8 * 4, 16, batch_first=True, bidirectional=True), nn.Linear(32, 10)

    def forward(self, x):
        y = F.relu(self.c2(F.relu(self.c1(x))))
        b, c, h, w = y.shape
        y, _ = self.lstm(y.permute(0, 3, 1, 2).reshape(b, w, c * h))
        return self.fc(y)


class Regrouped(nn.Module):
    """Reshapes whose rank and sizes come from computed shapes, then transposes."""

    def forward(self, x):
        b, c, h, w = x.shape
        y = x.view(*x.shape[:2], -1)
        y = y.view(y.shape[0], -1, 2, y.shape[-1] // 2).permute(0, 3, 1, 2)
        z = x.reshape(b, c, h * w).transpose(1, 2).reshape(b, h, w, c).permute(0, 3, 1, 2)
        return y.flatten(1).sum(1, keepdim=True), z * 2


class FloatSized(nn.Module):
    """Sizes computed in floats (floor, ceil, sqrt of a dim), as interpolate's recomputed scales are."""

    def forward(self, x):
        y = F.interpolate(x, scale_factor=0.5, mode="bilinear", recompute_scale_factor=True, align_corners=False)
        y = F.interpolate(y, scale_factor=1.7, mode="nearest", recompute_scale_factor=True)
        rows = (torch.tensor(x.shape[2], dtype=torch.float32) * 0.75).floor().long()
        cols = torch.sqrt(torch.tensor(x.shape[3], dtype=torch.float32)).ceil().long()
        return y.sum((2, 3)), x[:, :, :rows, :cols] * 2


def test_a_cnn_resizing_to_sizes_computed_from_its_input_agrees_with_onnxruntime_at_any_size(tmp_path):
    agrees_with_onnxruntime(exported(tmp_path, SizedByInput(), 3), images(3, (1, 16, 20), (2, 24, 12), (1, 9, 31)))


def test_a_resize_by_scales_of_sizes_a_strided_conv_computes_agrees_with_onnxruntime(tmp_path):
    agrees_with_onnxruntime(exported(tmp_path, ScaledOnly(), 3), images(3, (1, 16, 20), (3, 10, 7)))


def test_an_lstm_over_a_length_computed_from_the_image_width_agrees_with_onnxruntime(tmp_path):
    agrees_with_onnxruntime(exported(tmp_path, Recognizer(), 1), images(1, (1, 16, 40), (2, 16, 57), (1, 16, 5)))


def test_a_recognizer_run_at_more_widths_than_it_keeps_plans_for_agrees_at_each_and_stays_bounded(tmp_path):
    """Planned per input-shape signature: ten widths, each equal to onnxruntime, at most MEMBERS_KEPT kept."""
    path = exported(tmp_path, Recognizer(), 1)
    ours = graph_runner(load_onnx(path).graph, get("cpu"))
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for feed in images(1, *[(1 + w % 2, 16, w) for w in range(9, 49, 4)]) * 2:
        np.testing.assert_allclose(ours.run(feed)["out0"], session.run(None, feed)[0], rtol=1e-3, atol=1e-5)
    assert len(ours.members) == MEMBERS_KEPT


def test_reshapes_by_computed_shapes_then_transposes_agree_with_onnxruntime(tmp_path):
    agrees_with_onnxruntime(exported(tmp_path, Regrouped(), 3, outputs=2), images(3, (1, 6, 4), (2, 8, 6)))


def test_sizes_computed_in_floats_from_the_input_shape_agree_with_onnxruntime(tmp_path):
    agrees_with_onnxruntime(exported(tmp_path, FloatSized(), 3, outputs=2), images(3, (1, 16, 20), (2, 23, 13)))


# --- shape subgraphs as other exporters (tf2onnx, jax2tf) write them --------------------------------------

def info(name: str, dims) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def saved(tmp_path, nodes, inputs, outputs, constants: dict, opset: int = 17, check: bool = True) -> str:
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    if check:
        onnx.checker.check_model(model)
    path = str(tmp_path / "model.onnx")
    onnx.save(model, path)
    return path


def test_inputs_declared_with_minus_one_underscore_and_question_mark_dims_take_any_size(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["_", 3, "_", "?"])
    x.type.tensor_type.shape.dim[0].Clear()
    x.type.tensor_type.shape.dim[0].dim_value = -1
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=0)]
    path = saved(tmp_path, nodes, [x], [info("y", ["_", "_", "_"])], {"axes": np.array([1], np.int64)})
    agrees_with_onnxruntime(path, images(3, (1, 48, 192), (2, 5, 5), (3, 1, 7)))


@pytest.mark.parametrize("end", [INT64_MAX, INT32_MAX, TF_END])
def test_sentinel_slice_ends_mean_to_the_end_not_a_size(tmp_path, end):
    """x[:, 1:] on a symbolic axis, and the shape's tail (Shape -> Slice to a sentinel) made a Reshape's target."""
    nodes = [helper.make_node("Slice", ["x", "one", "end", "axis2"], ["tail"]),
             helper.make_node("Shape", ["tail"], ["shape"]),
             helper.make_node("Slice", ["shape", "one", "end"], ["dims"]),
             helper.make_node("Concat", ["minus_one", "dims"], ["target"], axis=0),
             helper.make_node("Reshape", ["tail", "target"], ["y"])]
    consts = {"one": np.array([1], np.int64), "end": np.array([end], np.int64), "axis2": np.array([2], np.int64),
              "minus_one": np.array([-1], np.int64)}
    path = saved(tmp_path, nodes, [info("x", ["N", 3, "H", "W"])], [info("y", ["N", 3, "_", "W"])], consts)
    agrees_with_onnxruntime(path, images(3, (4, 6, 5), (1, 2, 9)))


def test_shapes_computed_on_the_host_feed_constant_of_shape_range_expand_and_reshape_with_zero(tmp_path):
    """ConstantOfShape, Range, Expand and Reshape (0 keeps a dim, -1 infers one) by sizes taken from x."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "i3"], ["w"], axis=0),
             helper.make_node("Range", ["zero", "w", "one"], ["cols"]),
             helper.make_node("Cast", ["cols"], ["colsf"], to=TensorProto.FLOAT),
             helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=numpy_helper.from_array(np.ones(1, np.float32))),
             helper.make_node("Expand", ["colsf", "shape"], ["grid"]),
             helper.make_node("Add", ["grid", "ones"], ["g1"]),
             helper.make_node("Mul", ["g1", "x"], ["gx"]),
             helper.make_node("Reshape", ["gx", "keep_two"], ["y"])]
    consts = {"i3": np.array(3, np.int64), "zero": np.array(0, np.int64), "one": np.array(1, np.int64),
              "keep_two": np.array([0, 0, -1], np.int64)}
    path = saved(tmp_path, nodes, [info("x", ["N", 3, "H", "W"])], [info("y", ["N", 3, None])], consts)
    agrees_with_onnxruntime(path, images(3, (1, 4, 5), (2, 3, 8)))


def test_an_if_on_a_shape_predicate_takes_the_branch_the_input_size_picks(tmp_path):
    """if x.shape[2] > 4: x * 2 else x - 1 (tf2onnx writes such Ifs for shape checks)."""
    then = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["t"])], "then", [], [info("t", None)])
    other = helper.make_graph([helper.make_node("Sub", ["x", "onef"], ["e"])], "else", [], [info("e", None)])
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "i2"], ["h"], axis=0),
             helper.make_node("Greater", ["h", "four"], ["big"]),
             helper.make_node("If", ["big"], ["y"], then_branch=then, else_branch=other)]
    consts = {"i2": np.array(2, np.int64), "four": np.array(4, np.int64), "two": np.array(2, np.float32),
              "onef": np.array(1, np.float32)}
    path = saved(tmp_path, nodes, [info("x", ["N", 3, "H", "W"])], [info("y", ["N", 3, "H", "W"])], consts)
    agrees_with_onnxruntime(path, images(3, (1, 6, 5), (2, 3, 8)))


def test_a_squeeze_without_axes_drops_a_symbolic_dim_exactly_when_it_is_one(tmp_path):
    """The rank Squeeze leaves depends on the batch: 2 dims at batch 1, 3 at batch 2 (as onnxruntime)."""
    nodes = [helper.make_node("Squeeze", ["x"], ["s"]), helper.make_node("Shape", ["s"], ["shape"]),
             helper.make_node("Size", ["shape"], ["y"])]
    path = saved(tmp_path, nodes, [info("x", ["N", 3, 1, "W"])], [helper.make_tensor_value_info("y", TensorProto.INT64, [])], {})
    agrees_with_onnxruntime(path, [{"x": np.zeros((1, 3, 1, 5), np.float32)}, {"x": np.zeros((2, 3, 1, 4), np.float32)}])


def test_a_shape_edited_by_scatter_nd_reshapes_as_onnxruntime(tmp_path):
    """tf2onnx's way to set dims of a computed shape: ScatterND(Shape(x), [[1], [3]], [-1, 1]) -> Reshape."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("ScatterND", ["shape", "at", "dims"], ["target"]),
             helper.make_node("Reshape", ["x", "target"], ["y"])]
    consts = {"at": np.array([[1], [3]], np.int64), "dims": np.array([-1, 1], np.int64)}
    path = saved(tmp_path, nodes, [info("x", ["N", 3, "H", "W"])], [info("y", ["N", "_", "H", 1])], consts)
    agrees_with_onnxruntime(path, images(3, (1, 4, 5), (2, 3, 8)))


def test_a_loop_run_as_many_times_as_the_input_is_high_agrees_with_onnxruntime(tmp_path):
    """Loop(M = x.shape[2]): each step adds the row it is at, and writes its index out."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Gather", ["x", "i"], ["row"], axis=2),
         helper.make_node("Add", ["acc_in", "row"], ["acc_out"]),
         helper.make_node("Identity", ["i"], ["step"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []), info("acc_in", None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), info("acc_out", None),
         helper.make_tensor_value_info("step", TensorProto.INT64, [])])
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "i2"], ["h"], axis=0),
             helper.make_node("ReduceSum", ["x", "i2_axes"], ["zeros0"], keepdims=0),
             helper.make_node("Mul", ["zeros0", "zero_f"], ["acc0"]),
             helper.make_node("Loop", ["h", "true", "acc0"], ["y", "steps"], body=body)]
    consts = {"i2": np.array(2, np.int64), "i2_axes": np.array([2], np.int64), "zero_f": np.array(0, np.float32),
              "true": np.array(True)}
    path = saved(tmp_path, nodes, [info("x", ["N", 3, "H", "W"])],
                 [info("y", ["N", 3, "W"]), helper.make_tensor_value_info("steps", TensorProto.INT64, ["H"])], consts)
    agrees_with_onnxruntime(path, images(3, (1, 4, 5), (2, 7, 3)))


def test_a_graph_sized_by_its_inputs_whose_output_declares_no_shape_is_refused_naming_the_output(tmp_path):
    nodes = [helper.make_node("Squeeze", ["x"], ["y"])]
    path = saved(tmp_path, nodes, [info("x", ["N", 3])], [info("y", None)], {}, check=False)
    with pytest.raises(UnsupportedModelError, match=r"Squeeze.*every input and output declares its type and rank, "
                                                    r"and 'y' does not"):
        load_onnx(path)


@pytest.mark.parametrize("op, gates, reset", [("GRU", 3, 0), ("GRU", 3, 1), ("LSTM", 4, 0), ("RNN", 1, 0)])
def test_recurrent_layers_over_sequences_of_their_own_lengths_agree_with_onnxruntime(tmp_path, op, gates, reset):
    """sequence_lens given as data: each sequence stops at its length (zeros past it), a reverse pass starts
    at its last step; a GRU as torch exports it (linear_before_reset) adds R's bias inside the reset gate."""
    rng = np.random.default_rng(0)
    hidden, width = 5, 4
    weights = {"W": rng.standard_normal((2, gates * hidden, width)), "R": rng.standard_normal((2, gates * hidden, hidden)),
               "B": rng.standard_normal((2, 2 * gates * hidden))}
    outputs = ["y", "y_h"] + (["y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, ["x", "W", "R", "B", "lengths"], outputs, hidden_size=hidden, direction="bidirectional",
                            **({"linear_before_reset": reset} if op == "GRU" else {}))
    lengths = helper.make_tensor_value_info("lengths", TensorProto.INT32, ["N"])
    path = saved(tmp_path, [node], [info("x", ["S", "N", width]), lengths],
                 [info("y", ["S", 2, "N", hidden])] + [info(name, [2, "N", hidden]) for name in outputs[1:]],
                 {k: (0.5 * v).astype(np.float32) for k, v in weights.items()})
    feeds = [{"x": rng.standard_normal((steps, len(n), width)).astype(np.float32), "lengths": np.array(n, np.int32)}
             for steps, n in [(6, [6, 3, 1]), (4, [2, 4]), (3, [3, 3])]]
    agrees_with_onnxruntime(path, feeds)


def test_a_torch_gru_export_agrees_with_onnxruntime_at_two_lengths(tmp_path):
    torch.manual_seed(0)
    gru = nn.GRU(4, 6, batch_first=True, bidirectional=True).eval()
    path = str(tmp_path / "gru.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(gru, (torch.randn(1, 5, 4),), path, input_names=["x"], output_names=["y", "h"], opset_version=17,
                          dynamic_axes={"x": {0: "batch", 1: "steps"}, "y": {0: "batch", 1: "steps"}, "h": {1: "batch"}},
                          dynamo=False)
    rng = np.random.default_rng(0)
    agrees_with_onnxruntime(path, [{"x": rng.standard_normal((b, t, 4)).astype(np.float32)} for b, t in [(1, 5), (3, 9)]])


# --- real files that packages ship ----------------------------------------------------------------------

def package_file(package: str, *parts: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed")
    return os.path.join(os.path.dirname(spec.origin), *parts)


def test_silero_vads_sequence_model_an_lstm_over_its_inputs_length_agrees_with_onnxruntime():
    rng = np.random.default_rng(0)
    state = {"h": np.zeros((1, 1, 128), np.float32), "c": np.zeros((1, 1, 128), np.float32)}
    agrees_with_onnxruntime(package_file("silero_vad", "data", "silero_vad_16k_sequence.onnx"),
                            [{"input": 0.1 * rng.standard_normal((n, 576)).astype(np.float32), **state} for n in (3, 5)])


def test_piper_tashkeels_diacritizer_with_grus_over_given_lengths_agrees_with_onnxruntime():
    rng = np.random.default_rng(0)
    feeds = [{"char_inputs": rng.integers(1, 30, (b, n)), "diac_inputs": rng.integers(0, 8, (b, n)),
              "input_lengths": np.array(lengths, np.int64)} for b, n, lengths in [(1, 12, [12]), (2, 7, [7, 4])]]
    agrees_with_onnxruntime(package_file("piper", "tashkeel", "model.onnx"), feeds)

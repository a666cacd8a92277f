"""ONNX files that packages on PyPI ship, read from the installed packages (installed without their own
dependencies, never imported: their files alone) and run against onnxruntime on the same inputs in the same
test: basic-pitch's nmp.onnx (a tf2onnx export) and ddddocr's three models, a YOLOX-style detector, a
CNN+LSTM recognizer and its dynamically quantized variant (onnxruntime's DynamicQuantizeLSTM)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from soma_runtime.backends import get
from soma_runtime.engine.graph import graph_runner
from soma_runtime.errors import ModelLoadError
from soma_runtime.loaders import package_file
from soma_runtime.loaders.onnx import load_onnx

ort = pytest.importorskip("onnxruntime")
SAMPLES = 43844                    # basic-pitch's window: 2 s of 22050 Hz audio, less its overlap
GLYPHS = {"1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
          "2": ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
          "7": ["11111", "00001", "00010", "00100", "01000", "01000", "01000"]}


def ddddocr(name: str) -> str:
    return package_file("ddddocr", name)


def outputs(path: str, feeds: list[dict]) -> list[tuple[list, list]]:
    """Each feed's outputs, ours (by name) and onnxruntime's (in order), their shapes checked equal."""
    ours = graph_runner(load_onnx(path).graph, get("cpu"))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    runs = []
    for feed in feeds:
        got, want = ours.run(feed), session.run(None, feed)
        assert [got[name].shape for name in names] == [w.shape for w in want]
        runs.append(([got[name] for name in names], want))
    return runs


def relative_error(runs: list[tuple[list, list]]) -> float:
    """The largest |ours - onnxruntime's| of any output, relative to the largest |onnxruntime's| of that output."""
    return max(float(np.abs(g - w).max() / np.abs(w).max()) for got, want in runs for g, w in zip(got, want))


def lettered(text: str, height: int, width: int, cell: int, top: int, left: int) -> np.ndarray:
    """A grey picture, 0-255 [height, width]: `text` dark on light in a blocky font, each glyph's 5 x 7 dots
    drawn `cell` pixels wide and one more high, from (top, left)."""
    picture = np.full((height, width), 235, np.float32)
    for char in text:
        glyph = np.kron(np.array([[dot == "1" for dot in row] for row in GLYPHS[char]]), np.ones((cell + 1, cell), bool))
        picture[top:top + glyph.shape[0], left:left + glyph.shape[1]][glyph] = 30
        left += glyph.shape[1] + cell
    return picture


def text_line(text: str, width: int) -> dict:
    """A 64-pixel-high line of text as ddddocr feeds its recognizers: [1, 1, 64, width] in [-1, 1]."""
    pixels = lettered(text, 64, width, 5, 11, 6) / 255.0
    return {"input1": ((pixels - 0.5) / 0.5)[None, None]}


def test_basic_pitchs_tf2onnx_note_model_agrees_with_onnxruntime_at_batch_one_and_two():
    """Tones over a noise floor: its output is a log spectrum scaled by its smallest and largest bins, and
    over (near) silence the smallest bin's log amplifies f32 rounding; on tones with little noise
    onnxruntime differs from itself (optimized or not) by up to 0.3%."""
    rng = np.random.default_rng(0)
    t = np.arange(SAMPLES, dtype=np.float32) / 22050
    audio = [0.3 * np.sin(2 * np.pi * f * t) + 0.1 * rng.standard_normal(SAMPLES) for f in (220.0, 329.6)]
    feeds = [{"serving_default_input_2:0": np.stack(audio[:b]).astype(np.float32)[..., None]} for b in (1, 2)]
    assert relative_error(outputs(package_file("basic_pitch", "saved_models/icassp_2022/nmp.onnx"), feeds)) < 1e-3


def test_ddddocrs_detector_agrees_with_onnxruntime_on_two_pictures():
    pictures = [lettered("127", 416, 416, 12, 100, 60), lettered("71", 416, 416, 20, 200, 150)]
    feeds = [{"images": np.stack([grey, 0.9 * grey, 0.8 * grey])[None]} for grey in pictures]
    assert relative_error(outputs(ddddocr("common_det.onnx"), feeds)) < 1e-3


def test_ddddocrs_recognizer_agrees_with_onnxruntime_past_its_declared_output_shape(caplog):
    """The file declares its output [1, seqlen]; its nodes give [steps, 1, classes], as onnxruntime runs it:
    theirs is taken (a declared shape is a hint), with one warning for the model however many widths run."""
    assert relative_error(outputs(ddddocr("common.onnx"), [text_line("1", 40), text_line("27", 64)])) < 1e-3
    warned = [r.getMessage() for r in caplog.records if "output '387' is declared [1, seqlen]" in r.getMessage()]
    assert len(warned) == 1, warned


def test_ddddocrs_quantized_recognizer_reads_as_onnxruntime_does():
    """21 DynamicQuantizeLinear steps before the LSTM: onnxruntime's sigmoid (a polynomial) is the last bit off
    exact for most inputs, so a tensor's largest value, then its scale, can differ by that bit, and a code on a
    rounding edge by one; the quantizations downstream carry that on (measured: 0 to 1.1% of the largest
    logit, over widths 40 to 256, on text and on noise). Agreement is then the same character at every step,
    logits within 2%."""
    runs = outputs(ddddocr("common_old.onnx"), [text_line("1", 40), text_line("27", 64)])
    assert relative_error(runs) < 2e-2
    for (got,), (want,) in runs:
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def per_column_uint8(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same LSTM written with uint8 weights (zero point 128) and a scale per column of each direction."""
    out = {}
    for name, value in weights.items():
        if name.endswith("_quantized"):
            out[name] = (value.astype(np.int16) + 128).astype(np.uint8)
        elif name.endswith(("_scale", "_zero_point")):
            column = value.astype(np.uint8) + 128 if name.endswith("_zero_point") else value
            out[name] = np.repeat(column[:, None], 4 * 512, axis=1)
        else:
            out[name] = value
    return out


def lstm_alone(tmp_path, written) -> str:
    """A file of the quantized recognizer's DynamicQuantizeLSTM node alone (its weights as `written` gives them),
    its initial states made inputs."""
    model = onnx.load(ddddocr("common_old.onnx"))
    node = next(n for n in model.graph.node if n.op_type == "DynamicQuantizeLSTM")
    weights = written({t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in node.input})
    lstm = helper.make_node(node.op_type, ["x", *node.input[1:4], "", "h0", "c0", "", *node.input[8:]], ["y", "h", "c"],
                            node.name, domain=node.domain, **{a.name: helper.get_attribute_value(a) for a in node.attribute})
    def floats(name, *dims):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))
    state = (2, "batch", 512)
    graph = helper.make_graph([lstm], "lstm", [floats("x", "steps", "batch", 512), floats("h0", *state), floats("c0", *state)],
                              [floats("y", "steps", 2, "batch", 512), floats("h", *state), floats("c", *state)],
                              [numpy_helper.from_array(value, name) for name, value in weights.items()])
    path = str(tmp_path / "lstm.onnx")
    onnx.save(helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version), path)
    return path


@pytest.mark.parametrize("written", [lambda weights: weights, per_column_uint8], ids=["as shipped", "per column uint8"])
def test_ddddocrs_dynamically_quantized_lstm_agrees_with_onnxruntime(tmp_path, written):
    """Its DynamicQuantizeLSTM node alone (bidirectional, 512 wide; int8 weights with a scale per direction
    as shipped), on the same inputs: X quantized once, h at every step, products exact; agreeing while no
    rounding edge falls between onnxruntime's activations and ours."""
    path = lstm_alone(tmp_path, written)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((steps, batch, 512)).astype(np.float32),
              "h0": 0.5 * rng.standard_normal((2, batch, 512)).astype(np.float32),
              "c0": rng.standard_normal((2, batch, 512)).astype(np.float32)} for steps, batch in ((8, 1), (5, 3))]
    assert relative_error(outputs(path, feeds)) < 1e-3


def test_a_quantized_lstm_whose_zero_points_differ_within_a_direction_is_refused_naming_the_node(tmp_path):
    """onnxruntime's kernel takes one zero point per direction (and refuses others): so do we."""
    def uneven(weights):
        weights = per_column_uint8(weights)
        weights["360_zero_point"][1, 7] = 127
        return weights
    with pytest.raises(ModelLoadError, match=r"node 'LSTM_202_quant' \(DynamicQuantizeLSTM, opset 1\): its weights' "
                                             r"zero points differ within a direction"):
        graph_runner(load_onnx(lstm_alone(tmp_path, uneven)).graph, get("cpu")).run(
            {"x": np.zeros((2, 1, 512), np.float32), "h0": np.zeros((2, 1, 512), np.float32),
             "c0": np.zeros((2, 1, 512), np.float32)})

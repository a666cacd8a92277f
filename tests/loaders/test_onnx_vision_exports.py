"""Vision models as their users export them (issue 53): torchvision's classifiers through both torch exporters
(TorchScript and dynamo, dynamic batch and image axes; dynamo's weights in an external data file), ultralytics'
YOLOv8n and YOLO11n exported by ultralytics with dynamic axes (with and without NMS in the graph), and
torchvision's SSDlite detector with its post-processing (score threshold, top-k and batched NMS per class:
sizes only the data decides), each loaded, run at two input shapes and compared with onnxruntime on the same
inputs. The files are made by tests/exporters/vision.py in the exporters' environment (`make setup` builds
.venv-exporters), once per version of that script."""
from __future__ import annotations

import numpy as np
import pytest

from soma_runtime.backends import get
from soma_runtime.engine.graph import graph_runner
from soma_runtime.loaders.onnx import load_onnx
from tests.fixtures.vision_exports import vision_exports

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="session")
def exports() -> dict:
    """The exported files by name (made on first need: tests/fixtures/vision_exports.py)."""
    return vision_exports()["models"]


def feed_for(entry: dict, shape: list[int]) -> dict:
    rng = np.random.default_rng(sum(shape))
    x = rng.random(shape, np.float32) if entry.get("positive") else rng.standard_normal(shape).astype(np.float32)
    return {entry["input"]: x}


def agrees(entry: dict, rtol: float = 1e-3) -> None:
    """Ours and onnxruntime's outputs at each of the entry's input shapes: equal shapes, and values within rtol
    of the output's largest magnitude (a classifier's logits, a detector's box coordinates)."""
    ours = graph_runner(load_onnx(entry["path"]).graph, get("cpu"))
    session = ort.InferenceSession(entry["path"], providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for shape in entry["shapes"]:
        feed = feed_for(entry, shape)
        got = ours.run(feed)
        for name, want in zip(names, session.run(None, feed)):
            assert got[name].shape == want.shape, (name, shape)
            assert np.abs(want).max() > 0, f"{name} is all zeros at {shape}: the comparison would prove nothing"
            np.testing.assert_allclose(got[name], want, rtol=0, atol=rtol * float(np.abs(want).max()),
                                       err_msg=f"{entry['file']} {name} at {shape}")


CLASSIFIERS = [f"{model}-{exporter}.onnx" for model in ("resnet18", "mobilenet_v3_small", "efficientnet_b0",
                                                         "convnext_tiny", "vit_b_16")
               for exporter in ("torchscript", "dynamo")]


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_torchvision_classifier_agrees_with_onnxruntime_at_two_shapes(exports, name):
    agrees(exports[name])


@pytest.mark.parametrize("name", ["yolov8n.onnx", "yolo11n.onnx"])
def test_ultralytics_yolo_export_agrees_with_onnxruntime_at_two_shapes(exports, name):
    """ultralytics' own export (dynamic batch and image size; anchor-free head, DFL, [B, 84, anchors])."""
    agrees(exports[name])


@pytest.mark.parametrize("name", ["yolov8n-nms.onnx", "yolo11n-nms.onnx"])
def test_ultralytics_yolo_export_with_nms_in_the_graph_agrees_with_onnxruntime(exports, name):
    """[B, 300, 6] rows of box, score and class: the boxes over ultralytics' confidence (a count the data
    decides) suppressed by NonMaxSuppression, padded to 300."""
    agrees(exports[name])


def test_torchvision_ssdlite_detects_what_onnxruntime_does(exports):
    """Boxes, scores and labels of the kept detections. Random weights give many detections of close scores,
    and the two engines' scores differ in their last bits: where two scores are nearer than that, their order
    (and at the 300th, which one is kept) may differ. So each of onnxruntime's detections must have ours: the
    same label, a box and a score within tolerance; only those tied with the last one kept may be missing."""
    entry = exports["ssdlite320_mobilenet_v3_large-torchscript.onnx"]
    ours = graph_runner(load_onnx(entry["path"]).graph, get("cpu"))
    session = ort.InferenceSession(entry["path"], providers=["CPUExecutionProvider"])
    for shape in entry["shapes"]:
        feed = feed_for(entry, shape)
        got = ours.run(feed)
        boxes, scores, labels = session.run(None, feed)
        assert len(scores) > 10 and got["scores"].shape == scores.shape, (shape, got["scores"].shape, scores.shape)
        tie = 1e-3
        np.testing.assert_allclose(np.sort(got["scores"]), np.sort(scores), atol=tie)
        scale = float(np.abs(boxes).max())
        for box, score, label in zip(boxes, scores, labels):
            match = (got["labels"] == label) & (np.abs(got["scores"] - score) <= tie) & \
                (np.abs(got["boxes"] - box).max(axis=1) <= tie * scale)
            assert match.any() or score <= scores.min() + tie, (shape, box, score, label)

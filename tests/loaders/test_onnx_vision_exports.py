"""Vision models as their users export them (issue 53): torchvision's classifiers through both torch exporters
(TorchScript and dynamo, dynamic batch and image axes; dynamo's weights in an external data file) and ultralytics'
YOLOv8n and YOLO11n exported by ultralytics with dynamic axes, each loaded, run at two input shapes and compared
with onnxruntime on the same inputs. The files are made by tests/exporters/vision.py in the exporters'
environment (`make setup` builds .venv-exporters), once per version of that script."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from soma_runtime.backends import get
from soma_runtime.engine.graph import graph_runner
from soma_runtime.loaders.onnx import load_onnx

ort = pytest.importorskip("onnxruntime")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "exporters" / "vision.py"
PYTHON = ROOT / ".venv-exporters" / "bin" / "python"
EXPORTS_TIMEOUT = 1200                 # seconds: every export from scratch on 2 cores takes about 2 minutes


@pytest.fixture(scope="session")
def exports() -> dict:
    """The manifest of the exported files (made on first need under .venv-exporters/exports/<script hash>)."""
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: `make setup` builds the exporters' environment")
    out = PYTHON.parents[1] / "exports" / hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:16]
    manifest = out / "manifest.json"
    if not manifest.exists():
        done = subprocess.run([str(PYTHON), str(SCRIPT), str(out)], check=False, capture_output=True, text=True,
                              timeout=EXPORTS_TIMEOUT, env={**os.environ, "PYTHONPATH": ""})
        assert done.returncode == 0, done.stderr[-3000:]
    return {entry["file"]: {**entry, "path": str(out / entry["file"])}
            for entry in json.loads(manifest.read_text())["models"]}


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

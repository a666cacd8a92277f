"""DetectModel.detect on ultralytics' own YOLOv8n and YOLO11n exports (random weights, dynamic axes; plain and with
NMS in the graph) against ultralytics' own `predict` with the same weights on the same photos (scikit-image's),
run in the exporters' environment in the same session (tests/exporters/vision.py): each photo alone (predict's
rectangle letterbox) and all four as one batch (a square letterbox). Same count, and matched by class: IoU >= 0.99
per box and confidence within 1e-3. Thresholds, the classes filter and max_det cut as predict's do; bad
arguments and bad images are RequestErrors naming them."""
from __future__ import annotations

import numpy as np
import pytest

from soma_runtime.errors import RequestError
from soma_runtime.tasks import DetectModel, Runtime
from tests.fixtures.vision_exports import vision_exports

IOU_LEAST, CONF_WITHIN = 0.99, 1e-3
EXPORTS = ["yolov8n.onnx", "yolov8n-nms.onnx", "yolo11n.onnx", "yolo11n-nms.onnx"]


@pytest.fixture(scope="module")
def made() -> dict:
    return vision_exports()


@pytest.fixture(scope="module")
def detectors(made) -> dict[str, DetectModel]:
    runtime = Runtime("cpu")
    return {name: runtime.load(made["models"][name]["path"], progress=False) for name in EXPORTS}


def iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union; of two boxes without area (clipped flat against the image's edge), 1 where their
    corners agree within 1e-3 pixels, else 0."""
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else float(np.abs(a - b).max() <= 1e-3)


def agreement(ours, theirs) -> dict:
    """Each of ultralytics' detections (x1, y1, x2, y2, conf, class rows) matched to the one of ours of its class
    with the highest IoU, each of ours used once: the worst IoU and the largest confidence difference found
    (AssertionError unless the counts agree and every one has its match)."""
    assert len(ours) == len(theirs), f"{len(ours)} detections, ultralytics {len(theirs)}"
    free = list(range(len(ours)))
    worst_iou, worst_conf = 1.0, 0.0
    for row in theirs:
        same = [i for i in free if ours[i].class_id == int(row[5])]
        assert same, f"no detection of class {int(row[5])} left for {row}"
        best = max(same, key=lambda i: iou(np.array(ours[i].box), np.array(row[:4])))
        free.remove(best)
        worst_iou = min(worst_iou, iou(np.array(ours[best].box), np.array(row[:4])))
        worst_conf = max(worst_conf, abs(ours[best].confidence - row[4]))
    return {"iou": worst_iou, "conf": worst_conf}


def assert_agrees(ours, theirs) -> None:
    found = agreement(ours, theirs)
    assert found["iou"] >= IOU_LEAST and found["conf"] <= CONF_WITHIN, found


@pytest.mark.parametrize("name", EXPORTS)
def test_an_ultralytics_detect_export_opens_as_the_detect_task(detectors, name):
    model = detectors[name]
    assert model.task == "detect" and len(model.labels) == 80 and model.input_size is None
    assert model.info()["nms_in_graph"] == name.endswith("-nms.onnx") and model.info()["input_size"] == [640, 640]


def test_another_onnx_file_stays_a_graph(made):
    model = Runtime("cpu").load(made["models"]["resnet18-torchscript.onnx"]["path"], progress=False)
    assert model.task == "graph"
    with pytest.raises(RequestError, match=r"detect\(\) is for detect models; .* runs the graph task"):
        model.detect("photo.png")


@pytest.mark.parametrize("name", EXPORTS)
def test_each_photo_alone_gives_what_ultralytics_predict_gives(made, detectors, name):
    """One photo a call: predict's rectangle letterbox (padded to a multiple of the stride), its NMS settings."""
    predictions, model = made["predictions"], detectors[name]
    settings = predictions["settings"]
    theirs = predictions["models"][made["models"][name]["model"]]["single"]
    assert sum(len(rows) for rows in theirs) >= 40, "random weights that find too few boxes would prove little"
    for path, rows in zip(predictions["paths"], theirs):
        assert_agrees(model.detect(path, conf=settings["conf"], iou=settings["iou"], max_det=settings["max_det"]), rows)


@pytest.mark.parametrize("name", EXPORTS)
def test_photos_in_one_batch_give_what_ultralytics_predict_gives_for_the_batch(made, detectors, name):
    """Four photos of four sizes in one call: one batch (a square letterbox, as predict's for images of several
    sizes); the export with NMS in its graph runs them one at a time (its per-image loop is unrolled to batch 1)."""
    predictions, model = made["predictions"], detectors[name]
    theirs = predictions["models"][made["models"][name]["model"]]["batch"]
    ours = model.detect(predictions["paths"], conf=0.25, iou=0.45)
    assert len(ours) == len(theirs)
    for found, rows in zip(ours, theirs):
        assert_agrees(found, rows)


@pytest.mark.parametrize("name", ["yolo11n.onnx", "yolo11n-nms.onnx"])
def test_classes_conf_and_max_det_cut_what_predict_finds_as_predict_does(made, detectors, name):
    """Class-aware NMS: keeping one class keeps exactly predict's detections of that class; a higher conf keeps
    those over it; max_det keeps the best."""
    predictions, model = made["predictions"], detectors[name]
    path, rows = predictions["paths"][0], np.array(predictions["models"][made["models"][name]["model"]]["single"][0])
    common = int(np.bincount(rows[:, 5].astype(int)).argmax())
    assert_agrees(model.detect(path, classes=[common]), rows[rows[:, 5] == common])
    scores = np.sort(rows[:, 4])[::-1]
    middle = float(scores[len(scores) // 2 - 1] + scores[len(scores) // 2]) / 2     # between two scores: none at it
    assert_agrees(model.detect(path, conf=middle), rows[rows[:, 4] > middle])
    assert_agrees(model.detect(path, max_det=3), rows[:3])


@pytest.mark.parametrize("arguments, needle", [
    ({"conf": 1.5}, "conf must be a number in"), ({"iou": -0.1}, "iou must be a number in"),
    ({"conf": True}, "conf must be"), ({"max_det": 0}, "max_det must be an integer"),
    ({"max_det": 2.0}, "max_det must be an integer"), ({"classes": [80]}, r"classes must be .* in \[0, 79\]"),
    ({"classes": "person"}, "classes must be"), ({"classes": []}, "classes must be a non-empty list"),
])
def test_bad_arguments_are_request_errors_naming_them(made, detectors, arguments, needle):
    with pytest.raises(RequestError, match=needle):
        detectors["yolov8n.onnx"].detect(made["predictions"]["paths"][0], **arguments)


def test_bad_images_are_request_errors_naming_them(detectors, tmp_path):
    text = tmp_path / "notes.jpg"
    text.write_text("not an image at all")
    model = detectors["yolov8n.onnx"]
    with pytest.raises(RequestError, match="notes.jpg"):
        model.detect(str(text))
    with pytest.raises(RequestError, match=r"images\[1\]"):
        model.detect([np.zeros((32, 32, 3), np.uint8), b"GIF89a truncated"])
    with pytest.raises(RequestError, match="a list of 1 to"):
        model.detect([])


def test_a_fixed_size_export_letterboxes_to_its_size_and_fills_its_batch(made):
    """YOLO11n exported with fixed sizes (a batch of 2 at 640 x 640): every photo letterboxed to the square (predict's
    letterbox for a fixed input, the one its batch of four photos of four sizes got), three photos run as two
    batches, the second filled; alone, a photo is a batch filled too."""
    model = Runtime("cpu").load(made["models"]["yolo11n-static.onnx"]["path"], progress=False)
    assert model.task == "detect" and model.input_size == (640, 640) and model.batch_size == 2
    predictions = made["predictions"]
    theirs = predictions["models"]["yolo11n"]["batch"]
    for found, rows in zip(model.detect(predictions["paths"][:3]), theirs[:3]):
        assert_agrees(found, rows)
    assert_agrees(model.detect(predictions["paths"][3]), theirs[3])


def test_a_detectors_graph_stays_runnable_as_a_graph(detectors):
    """`run` gives the head's raw output, as before the detect task (a GraphModel's run)."""
    model = detectors["yolov8n.onnx"]
    x = np.random.default_rng(0).random((1, 3, 320, 320), np.float32)
    (name, out), = model.run({"images": x}).items()
    assert name == "output0" and out.shape == (1, 84, 2100) and model.info()["ops"]

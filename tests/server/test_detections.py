"""`POST /v1/detections`: an ultralytics YOLO11n export served by name, photos sent as data: URLs or bare base64,
the answer equal to the library's detect (and so to ultralytics' predict: tests/tasks/test_detect.py); bad images,
unknown fields and bad thresholds are 400s naming them, and a model of another task is refused."""
from __future__ import annotations

import base64
import io

import numpy as np
import PIL.Image
import pytest
from fastapi.testclient import TestClient

from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.server.app import create_app
from soma_runtime.server.registry import ModelRegistry
from soma_runtime.tasks import Runtime
from tests.fixtures.replies import refused
from tests.fixtures.vision_exports import photo_pixels, vision_exports


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    PIL.Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def served():
    registry = ModelRegistry(Runtime("cpu"), memory_budget=2**31)
    registry.load(vision_exports()["models"]["yolo11n.onnx"]["path"], "yolo")
    g = GraphBuilder()
    registry.load(g.output(g.sqrt(g.input("x", ("N",), "f32"))), "sqrt")
    with TestClient(create_app(registry)) as client:
        yield client, registry.get("yolo").model


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    return {name: png(pixels) for name, pixels in photo_pixels().items() if name in ("chelsea", "coffee")}


def test_one_image_as_a_data_url_gives_the_librarys_detections(served, photos):
    client, model = served
    url = "data:image/png;base64," + base64.b64encode(photos["chelsea"]).decode()
    r = client.post("/v1/detections", json={"model": "yolo", "image": url, "conf": 0.25, "iou": 0.45})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "yolo" and [d["index"] for d in body["data"]] == [0]
    want = [d.to_dict() for d in model.detect(photos["chelsea"])]
    assert len(want) > 5 and body["data"][0]["detections"] == want
    assert set(want[0]) == {"box", "class_id", "label", "confidence"}


def test_several_images_as_bare_base64_are_one_batch_with_the_filters(served, photos):
    client, model = served
    images = [base64.b64encode(photos[name]).decode() for name in ("chelsea", "coffee")]
    r = client.post("/v1/detections", json={"model": "yolo", "images": images, "max_det": 4, "classes": [69, 3]})
    assert r.status_code == 200, r.text
    want = model.detect([photos["chelsea"], photos["coffee"]], max_det=4, classes=[69, 3])
    assert [d["detections"] for d in r.json()["data"]] == [[d.to_dict() for d in found] for found in want]
    assert [d["index"] for d in r.json()["data"]] == [0, 1]


@pytest.mark.parametrize("body, needle", [
    ({"image": base64.b64encode(b"just some text, not an image").decode()}, "image: "),
    ({"image": "data:image/png;base64,bm90IGEgcG5n"}, "image: "),
    ({"image": "not base64 at all!"}, "neither"),
    ({"image": "/etc/passwd"}, "neither"),
    ({"image": "https://example.com/cat.jpg"}, "not fetched"),
    ({"images": ["data:image/png;base64,AAAA", "AAAA"]}, r"images\[0\]"),
    ({"images": []}, "images"),
    ({}, "send one image"),
    ({"image": "AAAA", "images": ["AAAA"]}, "send one image"),
    ({"image": "AAAA", "threshold": 0.5}, "threshold: unknown field"),
    ({"conf": 2.0}, "conf must be a number in"),
    ({"classes": [1000]}, "classes must be"),
    ({"max_det": 0}, "max_det must be"),
])
def test_bad_requests_are_400s_naming_what_is_wrong(served, photos, body, needle):
    client, _ = served
    body = {"model": "yolo", **body}
    if body.keys() & {"conf", "classes", "max_det"}:
        body["image"] = base64.b64encode(photos["chelsea"]).decode()
    refused(client.post("/v1/detections", json=body), needle)


def test_a_model_that_is_not_a_detector_is_refused(served, photos):
    client, _ = served
    r = client.post("/v1/detections", json={"model": "sqrt", "image": base64.b64encode(photos["chelsea"]).decode()})
    assert r.status_code == 400 and "runs the graph task" in r.json()["error"]["message"]
    missing = client.post("/v1/detections", json={"model": "nope", "image": "AAAA"})
    assert missing.status_code == 404

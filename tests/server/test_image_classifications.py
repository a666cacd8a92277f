"""`POST /v1/classifications` with images: a tiny ViT served by name, photos sent as data: URLs or bare base64, the
answer equal to the library's classify_image (and so to transformers: tests/tasks/test_classify.py); a text encoder's
request on the same path still answered as before; bad images, unknown fields, a bad top_k and a model of another
task are 400s naming them."""
from __future__ import annotations

import base64
import io

import numpy as np
import PIL.Image
import pytest
from fastapi.testclient import TestClient

from soma_runtime.server.app import create_app
from soma_runtime.server.registry import ModelRegistry
from soma_runtime.tasks import Runtime
from tests.fixtures import encoders
from tests.fixtures.replies import refused
from tests.fixtures.vit import build, photos


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    PIL.Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    vit, bert = tmp_path_factory.mktemp("vit"), tmp_path_factory.mktemp("bert")
    build(vit)
    encoders.build("bert", "sequence", bert)
    registry = ModelRegistry(Runtime("cpu"), memory_budget=2**31)
    registry.load(str(vit), "vit")
    registry.load(str(bert), "bert")
    with TestClient(create_app(registry)) as client:
        yield client, registry.get("vit").model


@pytest.fixture(scope="module")
def pictures() -> dict[str, bytes]:
    return {name: png(pixels) for name, pixels in photos().items() if name in ("chelsea", "coffee")}


def labelled(found):
    return [{"label": label, "score": score} for label, score in found]


def test_one_image_as_a_data_url_gives_the_librarys_labels(served, pictures):
    client, model = served
    url = "data:image/png;base64," + base64.b64encode(pictures["chelsea"]).decode()
    r = client.post("/v1/classifications", json={"model": "vit", "image": url, "top_k": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "vit" and [d["index"] for d in body["data"]] == [0]
    assert body["data"][0]["labels"] == labelled(model.classify_image(pictures["chelsea"], top_k=3))


def test_several_images_as_bare_base64_are_one_batch(served, pictures):
    client, model = served
    images = [base64.b64encode(pictures[name]).decode() for name in ("chelsea", "coffee")]
    r = client.post("/v1/classifications", json={"model": "vit", "images": images})
    assert r.status_code == 200, r.text
    want = model.classify_image([pictures["chelsea"], pictures["coffee"]])
    assert [d["labels"] for d in r.json()["data"]] == [labelled(found) for found in want]
    assert [len(d["labels"]) for d in r.json()["data"]] == [5, 5]           # top_k's default


def test_a_text_classifier_still_answers_input_on_the_same_path(served):
    client, _ = served
    r = client.post("/v1/classifications", json={"model": "bert", "input": "the quick brown fox"})
    assert r.status_code == 200, r.text
    assert {d["label"] for d in r.json()["data"][0]["labels"]} == {"entailment", "neutral", "contradiction"}


@pytest.mark.parametrize("body, needle", [
    ({"image": base64.b64encode(b"just some text, not an image").decode()}, "image: "),
    ({"image": "data:image/png;base64,bm90IGEgcG5n"}, "image: "),
    ({"image": "not base64 at all!"}, "neither"),
    ({"image": "/etc/passwd"}, "neither"),
    ({"image": "https://example.com/cat.jpg"}, "not fetched"),
    ({"images": ["data:image/png;base64,AAAA", "AAAA"]}, r"images\[0\]"),
    ({"images": []}, "images"),
    ({"image": "AAAA", "images": ["AAAA"]}, "send one image"),
    ({"image": "AAAA", "labels": ["cat"]}, "labels: unknown field"),
    ({"top_k": 0}, r"top_k must be an integer in \[1, 10\]"),
    ({"top_k": 11}, r"top_k must be an integer in \[1, 10\]"),
    ({"top_k": "3"}, "top_k"),
])
def test_bad_requests_are_400s_naming_what_is_wrong(served, pictures, body, needle):
    client, _ = served
    body = {"model": "vit", **body}
    if "top_k" in body:
        body["image"] = base64.b64encode(pictures["chelsea"]).decode()
    refused(client.post("/v1/classifications", json=body), needle)


def test_a_model_of_the_other_kind_is_refused(served, pictures):
    client, _ = served
    r = client.post("/v1/classifications", json={"model": "bert", "image": base64.b64encode(pictures["chelsea"]).decode()})
    assert r.status_code == 400 and "runs the encode task" in r.json()["error"]["message"]
    r = client.post("/v1/classifications", json={"model": "vit", "input": "a text"})
    assert r.status_code == 400 and "runs the encode_image task" in r.json()["error"]["message"]
    assert client.post("/v1/classifications", json={"model": "nope", "image": "AAAA"}).status_code == 404

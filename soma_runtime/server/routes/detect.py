"""The `detect` task's route: `POST /v1/detections` (JSON: model, `image` or `images`, each a base64 `data:` URL
or bare base64 of the file, and conf, iou, max_det, classes) answers each image's detections, boxes in its own
pixels. Images are decoded (image/io: never a local file, never the network; a bad image is a 400) and the
model run off the event loop, one request at a time per model."""
from __future__ import annotations

import base64
import binascii

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from soma_runtime.errors import RequestError
from soma_runtime.image.io import MAX_BYTES, URL_SCHEME, Image, load_image, load_image_url
from soma_runtime.server.http import ServerState, parse
from soma_runtime.server.registry import Served
from soma_runtime.tasks.detect import MAX_IMAGES

ELSEWHERE = "objects are detected by detect models (an ultralytics detect export); graphs run on /v1/run"


class DetectionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    image: str | None = None
    images: list[str] | None = Field(None, min_length=1, max_length=MAX_IMAGES)
    conf: float = 0.25
    iou: float = 0.45
    max_det: int = 300
    classes: list[int] | None = None


def image_of(text: str, name: str) -> Image:
    """An image sent as a `data:` URL, or as the bare base64 of its file (no local paths, no other URLs)."""
    if URL_SCHEME.match(text):
        return load_image_url(text, allow_files=False, name=name)
    if len(text) // 4 * 3 > MAX_BYTES + 3:
        raise RequestError(f"{name}: about {len(text) // 4 * 3} bytes, more than the {MAX_BYTES} taken")
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{name}: an image is a data: URL or the base64 of an image file; this is neither") from None
    return load_image(data, allow_files=False, name=name)


def detections(served: Served, body: DetectionRequest) -> list[list[dict]]:
    many = body.images is not None
    images = [image_of(text, f"images[{i}]") for i, text in enumerate(body.images)] if many else \
        [image_of(body.image, "image")]
    with served.lock:
        found = served.model.detect(images, conf=body.conf, iou=body.iou, max_det=body.max_det, classes=body.classes)
    return [[d.to_dict() for d in image] for image in found]


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/detections")
    async def detect(request: Request):
        body = await parse(request, DetectionRequest)
        if (body.image is None) == (body.images is None):
            raise RequestError("send one image as `image` or a list as `images` (a data: URL or base64 each)")
        served = state.model(body.model, "detect", ELSEWHERE)
        found = await run_in_threadpool(detections, served, body)
        return {"object": "list", "model": served.id,
                "data": [{"index": i, "detections": image} for i, image in enumerate(found)]}

    return routes

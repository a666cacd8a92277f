"""The `detect` task's route: `POST /v1/detections` (JSON: model, `image` or `images`, each a base64 `data:` URL or
bare base64 of the file, and conf, iou, max_det, classes) answers each image's detections, boxes in its own pixels.
Images are decoded as server/images.py says (a bad image is a 400) and the model run off the event loop, one
request at a time per model."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from soma_runtime.server.http import ServerState, parse
from soma_runtime.server.images import ImagesRequest
from soma_runtime.server.registry import Served

ELSEWHERE = "objects are detected by detect models (an ultralytics detect export); graphs run on /v1/run"


class DetectionRequest(ImagesRequest):
    conf: float = 0.25
    iou: float = 0.45
    max_det: int = 300
    classes: list[int] | None = None


def detections(served: Served, body: DetectionRequest) -> list[list[dict]]:
    images = body.decoded()
    with served.lock:
        found = served.model.detect(images, conf=body.conf, iou=body.iou, max_det=body.max_det, classes=body.classes)
    return [[d.to_dict() for d in image] for image in found]


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/detections")
    async def detect(request: Request):
        body = await parse(request, DetectionRequest)
        body.check_images()
        served = state.model(body.model, "detect", ELSEWHERE)
        found = await run_in_threadpool(detections, served, body)
        return {"object": "list", "model": served.id,
                "data": [{"index": i, "detections": image} for i, image in enumerate(found)]}

    return routes

"""The `encode_image` task's route: `POST /v1/classifications` with `image` or `images` (each a base64 `data:` URL or
the bare base64 of the file) and `top_k` answers each image's most likely labels by the model's own classifier. The
text encoders' requests on the same path (`input`) stay routes/encode.py's, which hands a body naming images here.
Images are decoded as detections' are (routes/detect.image_of: never a local file, never the network); the model runs
off the event loop, one request at a time per model."""
from __future__ import annotations

import json
import time

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from soma_runtime.errors import RequestError
from soma_runtime.server.http import ServerState, parse
from soma_runtime.server.registry import Served
from soma_runtime.server.routes.detect import image_of
from soma_runtime.tasks.vision import MAX_IMAGES

ELSEWHERE = "images are classified by image models (a ViT or DeiT directory); texts by encoders, sent as `input`"


class ImageClassificationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    image: str | None = None
    images: list[str] | None = Field(None, min_length=1, max_length=MAX_IMAGES)
    top_k: int = 5


async def names_images(request: Request) -> bool:
    """Whether a /v1/classifications body is an image request (it has `image` or `images`)."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):
        return False                                  # the text route's parse reports it
    return isinstance(body, dict) and ("image" in body or "images" in body)


def classified(served: Served, body: ImageClassificationRequest) -> list[list[tuple[str, float]]]:
    many = body.images is not None
    images = [image_of(text, f"images[{i}]") for i, text in enumerate(body.images)] if many else \
        [image_of(body.image, "image")]
    with served.lock:
        return served.model.classify_image(images, top_k=body.top_k)


async def classifications(state: ServerState, request: Request) -> dict:
    body = await parse(request, ImageClassificationRequest)
    if (body.image is None) == (body.images is None):
        raise RequestError("send one image as `image` or a list as `images` (a data: URL or base64 each)")
    served = state.model(body.model, "encode_image", ELSEWHERE)
    found = await run_in_threadpool(classified, served, body)
    return {"object": "list", "model": served.id, "created": int(time.time()),
            "data": [{"index": i, "labels": [{"label": label, "score": score} for label, score in labels]}
                     for i, labels in enumerate(found)]}

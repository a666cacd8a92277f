"""The `encode_image` task's route: `POST /v1/classifications` with `image` or `images` (each a base64 `data:` URL or
the bare base64 of the file) and `top_k` answers each image's most likely labels by the model's own classifier. The
text encoders' requests on the same path (`input`) stay routes/encode.py's, which hands a body naming images here.
Images are decoded as server/images.py says (never a local file, never the network); the model runs
off the event loop, one request at a time per model."""
from __future__ import annotations

import json
import time

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from soma_runtime.server.http import ServerState, parse
from soma_runtime.server.images import ImagesRequest
from soma_runtime.server.registry import Served

ELSEWHERE = "images are classified by image models (a ViT or DeiT directory); texts by encoders, sent as `input`"


class ImageClassificationRequest(ImagesRequest):
    top_k: int = 5


async def names_images(request: Request) -> bool:
    """Whether a /v1/classifications body is an image request (it has `image` or `images`)."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):
        return False                                  # the text route's parse reports it
    return isinstance(body, dict) and ("image" in body or "images" in body)


def classified(served: Served, body: ImageClassificationRequest) -> list[list[tuple[str, float]]]:
    images = body.decoded()
    with served.lock:
        return served.model.classify_image(images, top_k=body.top_k)


async def classifications(state: ServerState, request: Request) -> dict:
    body = await parse(request, ImageClassificationRequest)
    body.check_images()
    served = state.model(body.model, "encode_image", ELSEWHERE)
    found = await run_in_threadpool(classified, served, body)
    return {"object": "list", "model": served.id, "created": int(time.time()),
            "data": [{"index": i, "labels": [{"label": label, "score": score} for label, score in labels]}
                     for i, labels in enumerate(found)]}

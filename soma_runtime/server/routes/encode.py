"""The `encode` task's routes: `/v1/embeddings` (OpenAI's) and `/v1/classifications` (labels with
probabilities, zero-shot with given labels; a body with `image` or `images` is an image model's: routes/vision.py).
An encoder runs one call at a time, off the event loop."""
from __future__ import annotations

import base64
import time
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from soma_runtime.errors import RequestError
from soma_runtime.server.http import ServerState, parse
from soma_runtime.server.registry import Served
from soma_runtime.server.routes import vision

ELSEWHERE = "texts are generated on /v1/completions, graphs run on /v1/run"


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    model: str
    input: str | list[str] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


class ClassificationRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    model: str
    input: str | list[str] = Field(min_length=1)
    labels: list[str] | None = None


def locked(served: Served, fn, *args):
    with served.lock:
        return fn(*args)


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await parse(request, EmbeddingRequest)
        served = state.model(body.model, "encode", ELSEWHERE)
        model = served.model
        texts = [body.input] if isinstance(body.input, str) else body.input
        vectors = await run_in_threadpool(locked, served, model.embed, texts)
        if body.dimensions is not None:            # Matryoshka-style: the leading dims, renormalized if the model normalizes
            if body.dimensions > vectors.shape[1]:
                raise RequestError(f"dimensions must be at most {vectors.shape[1]} for {served.id}")
            vectors = vectors[:, : body.dimensions]
            if model.normalizes:
                vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        tokens = sum(len(model.tokenize(t)) for t in texts)

        def encode(v: np.ndarray):
            return base64.b64encode(v.astype(np.float32).tobytes()).decode() if body.encoding_format == "base64" else v.tolist()
        return {"object": "list", "model": served.id, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)]}

    @routes.post("/v1/classifications")
    async def classifications(request: Request):
        if await vision.names_images(request):
            return await vision.classifications(state, request)
        body = await parse(request, ClassificationRequest)
        served = state.model(body.model, "encode", ELSEWHERE)
        texts = [body.input] if isinstance(body.input, str) else body.input
        results = await run_in_threadpool(locked, served, lambda: [served.model.classify(t, body.labels) for t in texts])
        return {"object": "list", "model": served.id, "created": int(time.time()),
                "data": [{"index": i, "labels": [{"label": lab, "score": p} for lab, p in r]} for i, r in enumerate(results)]}

    return routes

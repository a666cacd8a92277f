"""The HTTP server: OpenAI-compatible routes plus soma's model, health and metrics routes.

Generation requests go to the model's continuous-batching scheduler; tokens come back from its
thread into this event loop and out as SSE chunks or one JSON body. A client that leaves, streaming or
not, cancels its jobs, whose KV pages are freed at the next step. Errors are OpenAI error objects: 400
bad request, 403 refused by policy, 404 unknown model, 503 overloaded, 507 a model that cannot fit
(security.py's Guard answers 401, 408, 413 and 415 before a route runs).
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware

from soma_runtime.api import EncoderModel
from soma_runtime.backends import detect_all
from soma_runtime.engine.generate import peak_rss_mb
from soma_runtime.errors import PromptTooLong, RequestError, SomaError
from soma_runtime.server import openai
from soma_runtime.server.metrics import ServerMetrics, render
from soma_runtime.server.registry import ModelNotFound, ModelRegistry, OutOfMemory, Served
from soma_runtime.server.security import Forbidden, Guard, Policy, inside

log = logging.getLogger("soma_runtime.server")
MAX_JSON_DEPTH = 64
GONE = object()             # queued when a non-streaming request's client disconnects


class Overloaded(SomaError):
    pass


class LoadRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    path: str
    id: str | None = None
    priority: int = Field(0, ge=-1000, le=1000)
    sha256: str | None = None


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


ERRORS = [(ModelNotFound, 404, "not_found_error", "model_not_found"), (OutOfMemory, 507, "insufficient_memory", None),
          (Forbidden, 403, "permission_error", None),
          (Overloaded, 503, "server_overloaded", None), (PromptTooLong, 400, "invalid_request_error", "context_length_exceeded"),
          (SomaError, 400, "invalid_request_error", None)]


def error_response(exc: Exception) -> JSONResponse:
    status, kind, code = next(((s, k, c) for cls, s, k, c in ERRORS if isinstance(exc, cls)), (500, "server_error", None))
    return JSONResponse(openai.error_body(str(exc), kind, code), status_code=status)


async def parse(request: Request, schema: type[BaseModel]):
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as exc:       # not JSON, not UTF-8, or nested past the parser's depth
        raise RequestError(f"the request body is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if depth(body) > MAX_JSON_DEPTH:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise RequestError(f"{where}: {first['msg']}") from None


def depth(value) -> int:
    """How deeply JSON containers nest in `value` (without recursion: bodies come from clients)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (its body is read: the next message can only be the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


class Generation:
    """A request's jobs on one model's scheduler, with their tokens as an async stream of (choice, Token)."""

    def __init__(self, served: Served, reqs, metrics: ServerMetrics, max_queue: int):
        scheduler = served.scheduler
        if scheduler.queue_depth + len(reqs) > max_queue:
            raise Overloaded(f"{scheduler.queue_depth} requests are queued for {served.id}; try again shortly")
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.served, self.metrics, self.jobs = served, metrics, []
        try:
            for i, req in enumerate(reqs):
                self.jobs.append(scheduler.submit(req, lambda item, i=i: loop.call_soon_threadsafe(self.queue.put_nowait, (i, item))))
        except BaseException:
            self.cancel()
            raise
        self.prompt_tokens = len(reqs[0].prompt_ids)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    @property
    def cached_tokens(self) -> int:
        stream = self.jobs[0].stream
        return stream.metrics.cached_tokens if stream is not None else 0

    async def tokens(self, request: Request | None = None) -> AsyncIterator:
        """(choice index, Token) until every job ends; with `request`, until its client leaves too."""
        watch = asyncio.ensure_future(self.watch(request)) if request else None
        open_jobs, first = len(self.jobs), True
        try:
            while open_jobs:
                i, item = await self.queue.get()
                if item is GONE:
                    return
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    open_jobs -= 1
                    continue
                if first:
                    self.metrics.first_token(self.served.id, self.jobs[i].first_token_s or 0.0)
                    first = False
                yield i, item
        finally:
            if watch is not None:
                watch.cancel()
            self.cancel()                     # no-op for finished jobs; frees the pages of the rest

    async def watch(self, request: Request) -> None:
        await disconnected(request)
        self.queue.put_nowait((None, GONE))


class Counted:
    """The outermost ASGI layer: counts every response by route and status (refusals included), and
    turns an exception that escaped everything else into a 500 error object; the server stays up."""

    def __init__(self, app, metrics: ServerMetrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def sent(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, sent)
        except Exception as exc:
            log.exception("unhandled error on %s", scope["path"])
            if status is None:
                response = error_response(exc)
                await response(scope, receive, sent)
        route = scope.get("route")
        path = route.path if route else scope["path"] if scope["path"] in self.routes else "unmatched"
        self.metrics.requests[(path, str(status or 500))] += 1


def create_app(registry: ModelRegistry, max_queue: int = 256, policy: Policy | None = None, allowed_origins: tuple[str, ...] = (),
               models_dir: str | None = None):
    """The server's ASGI app. Model management (load, unload) is on only with a `models_dir`, whose
    models are the only ones it loads; CORS answers only `allowed_origins` (default: none)."""
    metrics = ServerMetrics()
    backends = detect_all()

    @asynccontextmanager
    async def lifespan(app):
        yield
        registry.close()

    app = FastAPI(title="soma-runtime", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(SomaError)
    async def soma_error(request: Request, exc: SomaError):
        return error_response(exc)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return JSONResponse(openai.error_body(f"no route {request.method} {request.url.path}", "not_found_error"), 404)

    @app.exception_handler(405)
    async def bad_method(request: Request, exc):
        return JSONResponse(openai.error_body(f"{request.method} is not allowed on {request.url.path}"), 405)

    def generator(model_id: str) -> Served:
        served = registry.get(model_id)
        if not served.is_generator:
            raise RequestError(f"model {model_id!r} is an encoder; use /v1/embeddings or /v1/classifications")
        return served

    async def complete(request: Request, schema, chat: bool):
        body = await parse(request, schema)
        served = generator(body.model)
        reqs = await run_in_threadpool(body.engine_requests, served.model)
        gen = Generation(served, reqs, metrics, max_queue)
        rid = openai.new_id("chatcmpl" if chat else "cmpl")
        choices = [openai.Choice(i, served.model, chat) for i in range(len(reqs))]
        head = openai.envelope("chat" if chat else "text", body.stream, rid, served.id)
        echo = getattr(body, "echo", False) and served.model.detokenize(reqs[0].prompt_ids)
        if echo:
            for c in choices:
                c.text = echo
        if not body.stream:
            async for i, token in gen.tokens(request):
                choices[i].add(token)
            if any(c.finish_reason is None for c in choices):      # the client left
                return PlainTextResponse("", status_code=499)
            return {**head, "choices": [c.final() for c in choices],
                    "usage": openai.usage(gen.prompt_tokens, sum(c.tokens for c in choices), gen.cached_tokens)}

        async def events():
            if chat:
                for c in choices:
                    yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
            elif echo:
                for c in choices:
                    yield sse({**head, "choices": [{"index": c.index, "text": echo, "logprobs": None, "finish_reason": None}]})
            try:
                async for i, token in gen.tokens():
                    choices[i].add(token)
                    yield sse({**head, "choices": [choices[i].delta(token)]})
            except Exception as exc:              # headers are gone: the error travels as the last event
                log.exception("generation failed mid-stream")
                yield sse(openai.error_body(str(exc), "server_error"))
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": openai.usage(gen.prompt_tokens, sum(c.tokens for c in choices),
                                                                        gen.cached_tokens)})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, openai.ChatRequest, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, openai.CompletionRequest, chat=False)

    def model_card(served: Served) -> dict:
        return {"id": served.id, "object": "model", "created": int(served.loaded_at), "owned_by": "soma-runtime",
                "task": "generate" if served.is_generator else "encode", "priority": served.priority,
                "memory_bytes": served.bytes, "format": served.model.loaded.format}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(s) for s in list(registry.models.values())]}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        return model_card(registry.get(model_id))

    def managed() -> str:
        if models_dir is None:
            raise Forbidden("model management is off; start the server with --allow-model-management --models-dir DIR")
        return models_dir

    @app.post("/v1/models/load")
    async def load_model(request: Request):
        root = managed()
        body = await parse(request, LoadRequest)
        path = inside(root, body.path)
        if not os.path.exists(path):
            raise ModelNotFound(f"no model {body.path!r} in the models directory")
        return model_card(await run_in_threadpool(registry.load, path, body.id, body.priority, body.sha256))

    @app.delete("/v1/models/{model_id}")
    async def unload_model(model_id: str):
        managed()
        registry.unload(model_id)
        return {"id": model_id, "object": "model", "deleted": True}

    @app.get("/v1/health")
    async def health():
        return {"status": "ok", "models_loaded": list(registry.models), "backends": backends,
                "memory": {"peak_rss_mb": round(peak_rss_mb(), 1), "budget_bytes": registry.budget,
                           "models_bytes": registry.used_bytes}}

    @app.get("/v1/metrics")
    async def prometheus():
        return PlainTextResponse(render(metrics, registry), media_type="text/plain; version=0.0.4")

    def encoder(model_id: str) -> tuple[Served, EncoderModel]:
        served = registry.get(model_id)
        if served.is_generator:
            raise RequestError(f"model {model_id!r} generates text; embeddings and classifications need an encoder")
        return served, served.model

    def locked(served: Served, fn, *args):
        with served.lock:
            return fn(*args)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await parse(request, EmbeddingRequest)
        served, model = encoder(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        vectors = await run_in_threadpool(locked, served, model.embed, texts)
        if body.dimensions is not None:            # Matryoshka-style: the leading dims, renormalized if the model normalizes
            if body.dimensions > vectors.shape[1]:
                raise RequestError(f"dimensions must be at most {vectors.shape[1]} for {served.id}")
            vectors = vectors[:, : body.dimensions]
            if model.loaded.pooling.normalize:
                vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        tokens = sum(len(model.tokenize(t)) for t in texts)

        def encode(v: np.ndarray):
            return base64.b64encode(v.astype(np.float32).tobytes()).decode() if body.encoding_format == "base64" else v.tolist()
        return {"object": "list", "model": served.id, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)]}

    @app.post("/v1/classifications")
    async def classifications(request: Request):
        body = await parse(request, ClassificationRequest)
        served, model = encoder(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        results = await run_in_threadpool(locked, served, lambda: [model.classify(t, body.labels) for t in texts])
        return {"object": "list", "model": served.id, "created": int(time.time()),
                "data": [{"index": i, "labels": [{"label": lab, "score": p} for lab, p in r]} for i, r in enumerate(results)]}

    routes = {route.path for route in app.routes}
    guarded = Guard(app, policy or Policy())
    if allowed_origins:
        guarded = CORSMiddleware(guarded, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                                 allow_headers=["Authorization", "Content-Type"])
    return Counted(guarded, metrics, routes)

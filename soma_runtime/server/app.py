"""The HTTP server's app: one router per task (routes/generate.py, encode.py, graph.py, audio.py, detect.py; vision.py's
image classifications through encode.py's /v1/classifications) and the server's own (routes/models.py;
routes/context.py, the sessions' contexts; routes/retrieve.py, the served folders' pages), behind the security
guard (security.py), CORS where origins are allowed, and a counter of every response. Errors are OpenAI error
objects (http.py)."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from soma_runtime.engine.graph import DEFAULT_BUDGET
from soma_runtime.errors import SomaError
from soma_runtime.ir.plan import RunBudget
from soma_runtime.server import openai
from soma_runtime.server.http import ServerState
from soma_runtime.server.metrics import ServerMetrics
from soma_runtime.server.registry import ModelRegistry
from soma_runtime.server.routes import audio, context, detect, encode, generate, graph, models, retrieve
from soma_runtime.server.security import Guard, Policy

log = logging.getLogger("soma_runtime.server")
ROUTERS = (generate, encode, graph, audio, detect, models, context, retrieve)


class Counted:
    """The outermost ASGI layer: counts every response by route and status (refusals included), and
    turns an exception that escaped everything else into a 500 error object; the server stays up."""

    def __init__(self, app, state: ServerState, routes: set[str]):
        self.app, self.state, self.routes = app, state, routes

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
                response = self.state.error_response(exc)
                await response(scope, receive, sent)
        route = scope.get("route")
        path = route.path if route else scope["path"] if scope["path"] in self.routes else "unmatched"
        self.state.metrics.requests[(path, str(status or 500))] += 1


def create_app(registry: ModelRegistry, max_queue: int = 256, policy: Policy | None = None, allowed_origins: tuple[str, ...] = (),
               models_dir: str | None = None, hosts: frozenset[str] | None = None, run_budget: RunBudget | None = None,
               indexes: dict | None = None):
    """The server's ASGI app. Model management (load, unload) is on only with a `models_dir`, whose
    models are the only ones it loads; CORS answers only `allowed_origins` (default: none); requests
    naming a Host other than a loopback one or one of `hosts` are refused (Policy.hosts; None: any); a graph
    run may compute what `run_budget` allows (engine.graph.DEFAULT_BUDGET if None); /v1/retrieve answers from
    `indexes` only (routes/retrieve.open_indexes; none: every index is refused)."""
    state = ServerState(registry, ServerMetrics(), max_queue, models_dir, run_budget or DEFAULT_BUDGET, indexes=indexes or {})

    @asynccontextmanager
    async def lifespan(app):
        yield
        registry.close()

    app = FastAPI(title="soma-runtime", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(SomaError)
    async def soma_error(request: Request, exc: SomaError):
        return state.error_response(exc)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return JSONResponse(openai.error_body(f"no route {request.method} {request.url.path}", "not_found_error"), 404)

    @app.exception_handler(405)
    async def bad_method(request: Request, exc):
        return JSONResponse(openai.error_body(f"{request.method} is not allowed on {request.url.path}"), 405)

    paths = set()
    for module in ROUTERS:
        routes = module.router(state)
        paths |= {route.path for route in routes.routes}
        app.include_router(routes)
    guarded = Guard(app, policy or Policy(), hosts)
    if allowed_origins:
        guarded = CORSMiddleware(guarded, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                                 allow_headers=["Authorization", "Content-Type"])
    return Counted(guarded, state, paths)

"""The server's own routes: the models it holds (`/v1/models`; load and unload when management is on,
from the models directory only), `/v1/health` and `/v1/metrics` (Prometheus)."""
from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from soma_runtime.memory import peak_rss_mb
from soma_runtime.schedule import detect
from soma_runtime.server.http import ServerState, parse
from soma_runtime.server.metrics import render
from soma_runtime.server.registry import ModelNotFound, Served
from soma_runtime.server.security import Forbidden, inside


class LoadRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    path: str
    id: str | None = None
    priority: int = Field(0, ge=-1000, le=1000)
    sha256: str | None = None


def model_card(served: Served) -> dict:
    return {"id": served.id, "object": "model", "created": int(served.loaded_at), "owned_by": "soma-runtime",
            "task": served.model.task, "priority": served.priority, "memory_bytes": served.bytes, "format": served.model.format}


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()
    registry = state.registry
    backends = detect()

    def managed() -> str:
        if state.models_dir is None:
            raise Forbidden("model management is off; start the server with --allow-model-management --models-dir DIR")
        return state.models_dir

    @routes.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(s) for s in list(registry.models.values())]}

    @routes.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        return model_card(registry.get(model_id))

    @routes.post("/v1/models/load")
    async def load_model(request: Request):
        root = managed()
        body = await parse(request, LoadRequest)
        path = inside(root, body.path)
        if not os.path.exists(path):
            raise ModelNotFound(f"no model {body.path!r} in the models directory")
        return model_card(await run_in_threadpool(registry.load, path, body.id, body.priority, body.sha256))

    @routes.delete("/v1/models/{model_id}")
    async def unload_model(model_id: str):
        managed()
        registry.unload(model_id)
        return {"id": model_id, "object": "model", "deleted": True}

    @routes.get("/v1/health")
    async def health():
        return {"status": "ok", "models_loaded": list(registry.models), "backends": backends,
                "memory": {"peak_rss_mb": round(peak_rss_mb(), 1), "budget_bytes": registry.budget,
                           "models_bytes": registry.used_bytes}}

    @routes.get("/v1/memory")
    async def memory():
        return registry.memory()

    @routes.get("/v1/metrics")
    async def prometheus():
        return PlainTextResponse(render(state.metrics, registry), media_type="text/plain; version=0.0.4")

    return routes

"""The server's own routes: the models it holds (`/v1/models`; load and unload when management is on,
from the models directory only), their LoRA adapters (`/v1/lora-adapters`: listed always, loaded and
unloaded under the same rules), `/v1/health` and `/v1/metrics` (Prometheus)."""
from __future__ import annotations

import os
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from soma_runtime.errors import RequestError
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


class AdapterRequest(BaseModel):
    """`load` an adapter directory (`path`, inside the models directory) on a text model as `name` at `alpha`,
    `unload` one by name, or `list` them all. `model` may be left out where one text model is served."""
    model_config = ConfigDict(strict=True, extra="forbid")
    action: Literal["load", "unload", "list"] = "load"
    model: str | None = None
    path: str | None = None
    name: str | None = None
    alpha: float = 1.0


def model_card(served: Served) -> dict:
    return {"id": served.id, "object": "model", "created": int(served.loaded_at), "owned_by": "soma-runtime",
            "task": served.model.task, "priority": served.priority, "memory_bytes": served.bytes, "format": served.model.format}


def adapter_cards(served: Served) -> list[dict]:
    """A text model's adapters as models of their own (`base:adapter`, as requests may name them), paths left out."""
    if served.model.task != "generate":
        return []
    return [{"id": f"{served.id}:{a['name']}", "object": "model", "parent": served.id, "owned_by": "soma-runtime",
             "task": "generate", **{k: a[k] for k in ("name", "alpha", "rank", "params", "modules")}}
            for a in served.model.list_loras()]


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
        served = list(registry.models.values())
        return {"object": "list", "data": [model_card(s) for s in served] + [c for s in served for c in adapter_cards(s)]}

    def text_model(model_id: str | None) -> Served:
        if model_id is None:
            text = [s for s in list(registry.models.values()) if s.model.task == "generate"]
            if len(text) != 1:
                raise RequestError(f"name the `model` the adapter is for ({len(text)} text models are served)")
            return text[0]
        return state.model(model_id, "generate", "adapters change text models")

    @routes.get("/v1/lora-adapters")
    async def list_adapters():
        return {"object": "list", "data": [c for s in list(registry.models.values()) for c in adapter_cards(s)]}

    @routes.post("/v1/lora-adapters")
    async def manage_adapters(request: Request):
        body = await parse(request, AdapterRequest)
        if body.action == "list":
            return await list_adapters()
        root = managed()
        served = text_model(body.model)
        if body.action == "unload":
            if body.name is None:
                raise RequestError("unload needs the adapter's `name`")
            served.model.unload_lora(body.name)
            registry.remeasure(served.id)
            return {"id": f"{served.id}:{body.name}", "object": "model", "deleted": True}
        if body.path is None:
            raise RequestError("load needs the adapter directory's `path`")
        path = inside(root, body.path)
        if not os.path.exists(path):
            raise ModelNotFound(f"no adapter {body.path!r} in the models directory")
        loaded = await run_in_threadpool(served.model.load_lora, path, body.alpha, body.name)
        registry.remeasure(served.id)
        return next(c for c in adapter_cards(served) if c["name"] == loaded["name"])

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

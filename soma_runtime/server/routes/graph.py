"""The `graph` task's route: `POST /v1/run` runs a graph model on named inputs given as (nested) JSON
arrays, each read in the dtype the graph declares for it, and answers its named outputs the same way."""
from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from soma_runtime.dtypes import DTYPES
from soma_runtime.errors import RequestError
from soma_runtime.server.http import ServerState, parse
from soma_runtime.server.routes.encode import locked


class RunRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    model: str
    inputs: dict[str, list | float | int | bool]


def arrays(model, inputs: dict) -> dict[str, np.ndarray]:
    """Each input as an array of the dtype the graph declares for it (RequestError for values that are not)."""
    out = {}
    for name, value in inputs.items():
        meta = model.inputs.get(name)
        if meta is None:
            raise RequestError(f"the graph has no input {name!r}; it takes {', '.join(model.inputs)}")
        try:
            out[name] = np.array(value, dtype=DTYPES[meta.dtype].numpy)
        except (TypeError, ValueError, OverflowError):
            raise RequestError(f"input {name!r} is not a rectangular array of {meta.dtype} values") from None
    return out


def jsonable(value: np.ndarray):
    """An output as nested lists; a float that is no JSON number is named as JavaScript spells it."""
    value = np.asarray(value)
    if value.dtype.kind != "f" or np.isfinite(value).all():
        return value.tolist()
    spelled = np.where(np.isnan(value), "NaN", np.where(value > 0, "Infinity", "-Infinity"))
    return np.where(np.isfinite(value), value.astype(object), spelled).tolist()


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/run")
    async def run(request: Request):
        body = await parse(request, RunRequest)
        served = state.model(body.model, "graph", "texts are generated on /v1/completions, encoded on /v1/embeddings")
        outputs = await run_in_threadpool(locked, served, served.model.run, arrays(served.model, body.inputs))
        return {"object": "run", "model": served.id, "outputs": {name: jsonable(v) for name, v in outputs.items()}}

    return routes

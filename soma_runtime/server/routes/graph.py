"""The `graph` task's route: `POST /v1/run` runs a graph model on named inputs given as (nested) JSON
arrays, each read in the dtype the graph declares for it, and answers its named outputs the same way.

The inputs are read, the graph run and its answer encoded in a worker thread, the encoding in pieces
of at most CHUNK_VALUES numbers (json.dumps holds the GIL for the whole of one call), so a large answer
leaves the event loop free; an answer holds at most ANSWER_VALUES numbers."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from soma_runtime.dtypes import DTYPES
from soma_runtime.errors import RequestError
from soma_runtime.ir.plan import RunBudget
from soma_runtime.server.http import ServerState, parse
from soma_runtime.server.registry import Served
from soma_runtime.server.routes.encode import locked

ANSWER_VALUES = 1 << 21          # numbers one answer may hold (its JSON is at most ~25 bytes a number)
WIDEST_VALUE = 8                 # bytes of a number in the widest dtype an output may have
CHUNK_VALUES = 1 << 14           # numbers encoded by one json.dumps call (a few milliseconds of the GIL)


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


def encoded(value: np.ndarray) -> Iterator[str]:
    """An array as JSON text, in pieces of at most CHUNK_VALUES numbers: runs of rows, or a row's own pieces."""
    if value.ndim == 0 or value.size <= CHUNK_VALUES:
        yield json.dumps(jsonable(value), separators=(",", ":"))
        return
    row = value.size // len(value)
    rows = max(1, CHUNK_VALUES // row)
    yield "["
    for start in range(0, len(value), rows):
        if start:
            yield ","
        if row > CHUNK_VALUES:
            yield from encoded(value[start])
        else:
            yield json.dumps(jsonable(value[start:start + rows]), separators=(",", ":"))[1:-1]
    yield "]"


def answer(served: Served, inputs: dict, budget: RunBudget) -> bytes:
    """The run's answer as JSON (in a worker thread): RequestError past ANSWER_VALUES numbers (outputs of more
    bytes than the widest such answer are refused before they are computed)."""
    budget = dataclasses.replace(budget, output_bytes=min(budget.output_bytes, ANSWER_VALUES * WIDEST_VALUE))
    outputs = locked(served, served.model.run, arrays(served.model, inputs), budget)
    count = sum(int(v.size) for v in outputs.values())
    if count > ANSWER_VALUES:
        raise RequestError(f"the outputs hold {count} numbers, past the {ANSWER_VALUES} an answer may hold")
    pieces = [f'{{"object":"run","model":{json.dumps(served.id)},"outputs":{{']
    for i, (name, value) in enumerate(outputs.items()):
        pieces.append(("," if i else "") + json.dumps(name) + ":")
        pieces.extend(encoded(np.asarray(value)))
    pieces.append("}}")
    return "".join(pieces).encode()


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/run")
    async def run(request: Request):
        body = await parse(request, RunRequest)
        served = state.model(body.model, "graph", "texts are generated on /v1/completions, encoded on /v1/embeddings")
        return Response(await run_in_threadpool(answer, served, body.inputs, state.run_budget), media_type="application/json")

    return routes

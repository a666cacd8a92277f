"""The retrieval route: `POST /v1/retrieve` {"index", "query", "top"} ranks the pages of a folder the server
was started to serve (`--retrieval-dir [NAME=]DIR`, its index built beforehand by `soma-runtime index DIR`)
and answers `soma-runtime retrieve --json`'s list. `index` names a served folder by its name or its path;
any other is a 403, the same whether or not it exists. The index file is read again when it changes."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from soma_runtime.context.index import INDEX_FILE, PageIndex, recorded_model
from soma_runtime.errors import RequestError
from soma_runtime.server.http import ServerState, parse
from soma_runtime.server.security import MODEL_ID, Forbidden

MAX_TOP = 100


@dataclass
class ServedIndex:
    name: str
    index: PageIndex
    lock: threading.Lock = field(default_factory=threading.Lock)     # one query at a time: the encoder and the refresh


class RetrieveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    index: str = Field(min_length=1)
    query: str = Field(min_length=1)
    top: int = Field(5, ge=1, le=MAX_TOP)


def open_indexes(specs: list[str], runtime) -> dict[str, ServedIndex]:
    """`[NAME=]DIR` specs -> served indexes by name (NAME: the folder's name by default), each folder's index
    file read (RequestError, before the server starts, for a folder without one) with the encoder it was
    built with, loaded once per model through `runtime`."""
    served, encoders = {}, {}
    for spec in specs:
        name, sep, directory = spec.partition("=")
        if not sep or "/" in name:
            name, directory = os.path.basename(os.path.realpath(spec)), spec
        if not os.path.isdir(directory):
            raise RequestError(f"--retrieval-dir {spec}: not a directory")
        if not MODEL_ID.fullmatch(name):
            raise RequestError(f"--retrieval-dir {spec}: a name is 1 to 64 of A-Z a-z 0-9 . _ : -, got {name!r}; give NAME=DIR")
        if name in served:
            raise RequestError(f"--retrieval-dir {spec}: the name {name!r} is given twice")
        model = recorded_model(directory)
        if model is None:
            raise RequestError(f"--retrieval-dir {spec}: no {INDEX_FILE} there; build it with `soma-runtime index {directory}`")
        if model not in encoders:
            encoders[model] = runtime.load(model, progress=False)
        served[name] = ServedIndex(name, PageIndex(directory, encoders[model], model=model))
    return served


def find(indexes: dict[str, ServedIndex], wanted: str) -> ServedIndex:
    if wanted in indexes:
        return indexes[wanted]
    if "\0" not in wanted:
        target = os.path.realpath(wanted)
        for served in indexes.values():
            if served.index.folder.root == target:
                return served
    names = ", ".join(sorted(indexes)) or "none: start the server with --retrieval-dir [NAME=]DIR"
    raise Forbidden(f"index must name a folder this server serves ({names})")


def retrieve(served: ServedIndex, query: str, top: int) -> list[dict]:
    with served.lock:
        served.index.refresh()
        return [hit.to_json() for hit in served.index.retrieve(query, top=top)]


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/retrieve")
    async def retrieve_pages(request: Request):
        body = await parse(request, RetrieveRequest)
        served = find(state.indexes, body.index)
        return await run_in_threadpool(retrieve, served, body.query, body.top)

    return routes

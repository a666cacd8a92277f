"""What every route shares: the server's state, request bodies parsed (JSON only, depth-checked,
typed by a schema), and errors as OpenAI error objects: 400 bad request, 403 refused by policy, 404
unknown model, 503 overloaded, 507 a model that cannot fit (security.py's Guard answers 401, 408, 413,
415 and 421 before a route runs). An error's message names files relative to the models directory or
to the model's own directory: a client never learns where the server keeps its files. An unknown session
is a 404 as an unknown model is, and a server holding its most sessions answers 503."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from soma_runtime.errors import PromptTooLong, RequestError, SomaError
from soma_runtime.ir.plan import RunBudget
from soma_runtime.server import openai
from soma_runtime.server.metrics import ServerMetrics
from soma_runtime.server.registry import ModelNotFound, ModelRegistry, OutOfMemory, Served
from soma_runtime.server.security import Forbidden
from soma_runtime.server.sessions import SessionNotFound, Sessions, TooManySessions

MAX_JSON_DEPTH = 64


class Overloaded(SomaError):
    pass


@dataclass
class ServerState:
    registry: ModelRegistry
    metrics: ServerMetrics
    max_queue: int
    models_dir: str | None
    run_budget: RunBudget                 # what one graph run may compute
    sessions: Sessions = field(default_factory=Sessions)      # conversations by id (/v1/context/*)
    indexes: dict = field(default_factory=dict)               # served folders' page indexes by name (/v1/retrieve)

    def model(self, model_id: str, task: str, use: str) -> Served:
        """The served model `model_id`, which must run `task` (RequestError naming the route to `use`)."""
        served = self.registry.get(model_id)
        if served.model.task != task:
            raise RequestError(f"model {model_id!r} runs the {served.model.task} task; {use}")
        return served

    def error_response(self, exc: Exception) -> JSONResponse:
        status, kind, code = next(((s, k, c) for cls, s, k, c in ERRORS if isinstance(exc, cls)), (500, "server_error", None))
        return JSONResponse(openai.error_body(self.scrub(str(exc)), kind, code), status_code=status)

    def scrub(self, message: str) -> str:
        """`message` with the server's directories cut from the paths in it: the models directory first
        (a file in it is named relative to it), then those of the models served (a file by its name)."""
        models_dir = [self.models_dir] if self.models_dir else []
        folders = [served.index.folder.root for served in self.indexes.values()]
        served = sorted([*self.registry.directories(), *folders], key=len, reverse=True)
        for directories in (models_dir, served):
            for directory in directories:
                for form in {os.path.abspath(directory), os.path.realpath(directory)}:
                    if form != os.sep:
                        message = message.replace(form + os.sep, "")
        return message


ERRORS = [(ModelNotFound, 404, "not_found_error", "model_not_found"), (OutOfMemory, 507, "insufficient_memory", None),
          (SessionNotFound, 404, "not_found_error", "session_not_found"), (TooManySessions, 503, "server_overloaded", None),
          (Forbidden, 403, "permission_error", None),
          (Overloaded, 503, "server_overloaded", None), (PromptTooLong, 400, "invalid_request_error", "context_length_exceeded"),
          (SomaError, 400, "invalid_request_error", None)]


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
        if first["type"] == "extra_forbidden":
            raise RequestError(f"{where}: unknown field; a field this server does not act on is refused, "
                               "not ignored") from None
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

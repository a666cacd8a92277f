"""Who may call the server and what a request may cost before a route sees it.

`Guard` is the outermost ASGI layer: it checks the API key (`Authorization: Bearer`, as vLLM and
llama-server do; /v1/health is open), refuses bodies that are not JSON (a browser's cross-site
`text/plain` form post runs no route), reads the whole body within a size and a time limit, and
bounds how long one write to a client may block. `GuardedH11` times out request heads that never
finish (slowloris). `inside` confines model paths to the models directory. Model ids and metrics
labels are checked and escaped here too. Nothing here knows models or the engine.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
import re
import time
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from soma_runtime.errors import RequestError
from soma_runtime.server.openai import error_body

OPEN_PATHS = ("/v1/health",)                 # answered without the API key (load balancers' probes)
UPLOAD_PATHS = ("/v1/audio/transcriptions",)  # take multipart/form-data (a file), up to the upload limit
MODEL_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class Forbidden(RequestError):
    """The server's policy refuses this request (model management off, a path outside the models dir)."""


@dataclass(frozen=True)
class Policy:
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    max_upload_bytes: int = 25 * 2**20     # an uploaded file (OpenAI's limit for audio)
    body_seconds: float = 30.0             # the whole body must arrive within this
    head_seconds: float = 10.0             # ... and a request's head (its line and headers) within this
    send_seconds: float = 60.0             # one write to a client that does not read may block this long


class Guard:
    """The ASGI layer that enforces a Policy on every HTTP request."""

    def __init__(self, app, policy: Policy):
        self.app, self.policy = app, policy
        self.key = policy.api_key.encode() if policy.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = self.refusal(scope, headers)
        if refusal is not None:
            return await respond(send, *refusal)
        body = b""
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body, refusal = await self.read_body(receive, self.limit(scope))
            if refusal is not None:
                return await respond(send, *refusal)
        await self.app(scope, replay(body, receive), self.bounded(send))

    def refusal(self, scope, headers: dict) -> tuple[int, str, str] | None:
        """(status, error type, message) for a request refused on its head alone."""
        if self.key is not None and scope["path"] not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return 401, "authentication_error", "a valid API key is required: send 'Authorization: Bearer <key>'"
        if scope["method"] in ("POST", "PUT", "PATCH"):
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            upload = scope["path"] in UPLOAD_PATHS
            if upload and media != b"multipart/form-data":
                return 415, "invalid_request_error", "send the file as multipart/form-data"
            if not upload and media != b"application/json":
                return 415, "invalid_request_error", "the request body must be JSON, sent as Content-Type: application/json"
            length, limit = headers.get(b"content-length"), self.limit(scope)
            if length is not None and (not length.isdigit() or int(length) > limit):
                return 413, "invalid_request_error", f"the request body is over {limit} bytes"
        return None

    def limit(self, scope) -> int:
        return self.policy.max_upload_bytes if scope["path"] in UPLOAD_PATHS else self.policy.max_body_bytes

    async def read_body(self, receive, limit: int) -> tuple[bytes, tuple | None]:
        """The whole body, or a refusal: too large (413), too slow (408), or the client gone."""
        chunks, size = [], 0
        deadline = time.monotonic() + self.policy.body_seconds
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return b"", (408, "invalid_request_error",
                             f"the request body did not arrive within {self.policy.body_seconds:g} s")
            if message["type"] == "http.disconnect":
                return b"", (400, "invalid_request_error", "the client left before sending its body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", (413, "invalid_request_error", f"the request body is over {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks), None

    def bounded(self, send):
        """`send`, failing a write that a client who does not read blocks past the policy's limit."""
        async def timed(message):
            try:
                await asyncio.wait_for(send(message), self.policy.send_seconds)
            except asyncio.TimeoutError:
                raise ConnectionError(f"the client read nothing for {self.policy.send_seconds:g} s") from None
        return timed


def replay(body: bytes, receive):
    """A receive that gives the body read already, then what the connection sends (its disconnect)."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return again


async def respond(send, status: int, kind: str, message: str) -> None:
    payload = json.dumps(error_body(message, kind)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on every request head: a connection whose request
    line and headers do not arrive in `head_seconds` is closed (uvicorn times out only idle ones)."""

    def __init__(self, *args, head_seconds: float = Policy.head_seconds, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_seconds, self.head_timer = head_seconds, None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.head_timer = self.loop.call_later(self.head_seconds, self.head_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:           # a head is still arriving: keep (or start) its clock
            if self.head_timer is None:
                self.head_timer = self.loop.call_later(self.head_seconds, self.head_timeout)
        elif self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()                  # the next head's clock starts with its first byte
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def connection_lost(self, exc) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)

    def head_timeout(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request head did not arrive in %g s", self.head_seconds)
            self.transport.close()


def check_model_id(model_id: str) -> str:
    if not isinstance(model_id, str) or not MODEL_ID.fullmatch(model_id):
        raise RequestError(f"a model id is 1 to 64 of the characters A-Z a-z 0-9 . _ : -, got {model_id!r}")
    return model_id


def safe_model_id(name: str) -> str:
    """A valid model id made from a file name (other characters become '-')."""
    return re.sub(r"[^A-Za-z0-9._:-]", "-", name)[:64].strip("-") or "model"


def inside(directory: str, path: str) -> str:
    """`path` (relative to `directory`, or absolute) resolved with its symlinks, if it lies inside
    `directory`; else Forbidden, with the same words whether or not such a path exists."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise Forbidden("path must name a model inside the server's models directory")
    root = os.path.realpath(directory)
    target = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, target]) != root or target == root:
        raise Forbidden("path must name a model inside the server's models directory")
    return target


def label_value(value) -> str:
    """A Prometheus label value, escaped as its text format requires (backslash, quote, newline)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

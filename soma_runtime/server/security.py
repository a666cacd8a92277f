"""Who may call the server and what a request may cost before a route sees it.

`Guard` is the outermost ASGI layer: it answers only the Host names the bind allows (DNS rebinding:
on a loopback bind, loopback names and `allowed_hosts` alone, as Jupyter does), checks the API key
(`Authorization: Bearer`, as vLLM and llama-server do; /v1/health is open), refuses bodies that are
not JSON (a browser's cross-site `text/plain` form post runs no route), reads the whole body within a
size and a time limit, and bounds how long one write to a client may block. `GuardedH11` bounds every
request head in bytes (MAX_HEAD_BYTES, MAX_TARGET_BYTES) and in time (slowloris), and closes a
connection whose client may still be sending by lingering (LINGER_BYTES, LINGER_SECONDS) so that it
reads the answer instead of a reset. `inside` confines model paths to the models directory. Model ids
and metrics labels are checked and escaped here too. Nothing here knows models or the engine.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import numbers
import os
import re
import time
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from soma_runtime.errors import RequestError
from soma_runtime.server.openai import error_body

OPEN_PATHS = ("/v1/health",)                 # answered without the API key (load balancers' probes)
UPLOAD_PATHS = ("/v1/audio/transcriptions",)  # take multipart/form-data (a file), up to the upload limit
MODEL_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
MAX_HEAD_BYTES = 64 * 1024          # a request's line and headers together past this: 431, then close
MAX_TARGET_BYTES = 8 * 1024         # a request target (path and query) past this: 414 (nginx's and Apache's 8K)
LINGER_BYTES = 64 * 2**20           # what is read and dropped of a body refused unread before closing ...
LINGER_SECONDS = 5.0                # ... and for how long at most (nginx's lingering close)
HOST_NAME = re.compile(r"[a-z0-9._:*-]+")
TARGET_TOO_LONG = 414, f"the request target is over {MAX_TARGET_BYTES} bytes"
HEAD_TOO_LARGE = 431, f"the request line and headers are over {MAX_HEAD_BYTES} bytes"


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
    allowed_hosts: tuple[str, ...] = ()    # Host names answered besides the loopback ones; "*": any (see hosts)

    def __post_init__(self):
        """RequestError for a limit that would refuse every request (a timeout of -1 s, NaN, 0 bytes)."""
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise RequestError("the API key must be a non-empty string")
        for name in ("max_body_bytes", "max_upload_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise RequestError(f"{name} must be a whole number of bytes, at least 1, got {value!r}")
        for name in ("body_seconds", "head_seconds", "send_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
                raise RequestError(f"{name} must be a finite number of seconds above 0, got {value!r}")
        if isinstance(self.allowed_hosts, str):
            raise RequestError(f"allowed_hosts is a sequence of host names, got the string {self.allowed_hosts!r}")
        object.__setattr__(self, "allowed_hosts", tuple(map(allowed_host, self.allowed_hosts)))

    def hosts(self, bind: str, uds: str | None) -> frozenset[str] | None:
        """The Host names answered besides the loopback ones (localhost, 127.0.0.1, [::1]) when listening
        on `bind` (or the unix socket `uds`); None: any. A loopback bind answers only those and
        `allowed_hosts`, so a web page whose name rebinds to 127.0.0.1 cannot drive it; other binds and
        unix sockets answer any name unless `allowed_hosts` is given."""
        if "*" in self.allowed_hosts or (not self.allowed_hosts and (uds is not None or not loopback(bind))):
            return None
        return frozenset(self.allowed_hosts)


def loopback(host: str) -> bool:
    """Whether `host` (a bind address or a Host header's name) is this machine's loopback alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The name of a Host header's value (or of an allowed host), lower case, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):                       # an IPv6 literal: [::1]:8000
        return value[1:].partition("]")[0]
    if value.count(":") == 1:                       # name:port (a bare IPv6 address has several colons)
        value = value.partition(":")[0]
    return value.rstrip(".")


def allowed_host(name) -> str:
    if not isinstance(name, str) or not HOST_NAME.fullmatch(host_name(name)):
        raise RequestError(f"allowed_hosts: {name!r} is not a host name or address (such as example.com or 10.0.0.5)")
    return host_name(name)


class Guard:
    """The ASGI layer that enforces a Policy on every HTTP request."""

    def __init__(self, app, policy: Policy, hosts: frozenset[str] | None = None):
        """`hosts`: the Host names answered besides the loopback ones (Policy.hosts; None: any)."""
        self.app, self.policy, self.hosts = app, policy, hosts
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
        host = host_name(headers.get(b"host", b"").decode("latin-1"))
        if self.hosts is not None and host and host not in self.hosts and not loopback(host):
            # a request without a Host (HTTP/1.0) comes from no browser, so from no rebinding page
            return 421, "invalid_request_error", (f"this server does not answer to the host name {host!r}; start it with "
                                                  "--allowed-hosts to add names")
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


def error_json(message: str, kind: str = "invalid_request_error") -> bytes:
    return json.dumps(error_body(message, kind)).encode()


async def respond(send, status: int, kind: str, message: str) -> None:
    payload = error_json(message, kind)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class BoundedHeads(h11.Connection):
    """h11's server side with every request head held to MAX_HEAD_BYTES and MAX_TARGET_BYTES. h11's own
    limit (max_incomplete_event_size) applies only to a head still incomplete when a read ends, so a
    head that arrives whole within one read (a 100 KB request line) passed; here each head is measured
    as the bytes h11 took from its first byte to its end. `refusal`: (status, message) of the last
    protocol error, for the answer."""

    def __init__(self):
        super().__init__(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.received = 0                   # bytes given to h11 on this connection ...
        self.head_start = 0                 # ... and of them, those before the current request's head
        self.refusal: tuple[int, str] | None = None

    def receive_data(self, data: bytes) -> None:
        self.received += len(data)
        super().receive_data(data)

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = self.explained(exc)
            raise
        if isinstance(event, h11.Request):
            self.refusal = self.oversized(event)
            if self.refusal is not None:
                raise h11.RemoteProtocolError(self.refusal[1], error_status_hint=self.refusal[0])
        return event

    def oversized(self, request: h11.Request) -> tuple[int, str] | None:
        if len(request.target) > MAX_TARGET_BYTES:
            return TARGET_TOO_LONG
        if self.received - len(self.trailing_data[0]) - self.head_start > MAX_HEAD_BYTES:
            return HEAD_TOO_LARGE
        return None

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self.head_start = self.received - len(self.trailing_data[0])

    def explained(self, exc: h11.RemoteProtocolError) -> tuple[int, str]:
        if exc.error_status_hint != 431:            # h11's words for a malformed head
            return exc.error_status_hint, f"invalid HTTP request: {exc}"
        return TARGET_TOO_LONG if b"\n" not in self.trailing_data[0] else HEAD_TOO_LARGE   # no newline: the request line


class Lingering:
    """A connection's transport as uvicorn sees it: `close` goes through GuardedH11.linger (everything
    else is the socket transport's own)."""

    def __init__(self, protocol: GuardedH11):
        self.protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self.protocol.socket, name)

    def close(self) -> None:
        self.protocol.linger()

    def is_closing(self) -> bool:
        return self.protocol.lingered is not None or self.protocol.socket.is_closing()


class GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with limits on every request head: its size (BoundedHeads: 431 or 414,
    then close) and a deadline (a connection whose request line and headers do not arrive in
    `head_seconds` is closed; uvicorn times out only idle ones). A close while the client may still be
    sending (a body refused unread, a head refused midway) lingers: our side is shut, what the client
    sends is read and dropped for up to LINGER_BYTES or LINGER_SECONDS, then the connection closes,
    so the client reads the answer (a 413) instead of a connection reset."""

    def __init__(self, *args, head_seconds: float = Policy.head_seconds, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = BoundedHeads()
        self.head_seconds, self.head_timer = head_seconds, None
        self.socket = None                          # the connection's transport (uvicorn's goes through Lingering)
        self.lingered: int | None = None            # bytes dropped since the close began lingering
        self.linger_timer = None

    def connection_made(self, transport) -> None:
        self.socket = transport
        super().connection_made(Lingering(self))
        self.head_timer = self.loop.call_later(self.head_seconds, self.head_timeout)

    def data_received(self, data: bytes) -> None:
        if self.lingered is not None:
            self.lingered += len(data)
            if self.lingered > LINGER_BYTES:
                self.socket.close()
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:           # a head is still arriving: keep (or start) its clock
            if self.head_timer is None:
                self.head_timer = self.loop.call_later(self.head_seconds, self.head_timeout)
        elif self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def linger(self) -> None:
        """Close, lingering first if the client may still be sending (its body, or the rest of a refused head)."""
        if self.lingered is not None or self.socket.is_closing():
            return
        if self.conn.their_state not in (h11.SEND_BODY, h11.ERROR) or not self.socket.can_write_eof():
            return self.socket.close()
        self.lingered = 0
        self.socket.write_eof()                         # the answer goes out whole, then our side shuts
        self.socket.resume_reading()
        self.linger_timer = self.loop.call_later(LINGER_SECONDS, self.socket.close)

    def send_400_response(self, msg: str) -> None:
        """The answer to a request h11 refused (uvicorn's is always a text 400): its status, as an error object."""
        status, message = self.conn.refusal or (400, msg)
        payload = error_json(message)
        response = h11.Response(status_code=status, reason=STATUS_PHRASES[status],
                                headers=[(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload)),
                                         (b"connection", b"close")])
        self.transport.write(self.conn.send(response) + self.conn.send(h11.Data(data=payload))
                             + self.conn.send(h11.EndOfMessage()))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()                  # the next head's clock starts with its first byte
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def connection_lost(self, exc) -> None:
        for timer in (self.head_timer, self.linger_timer):
            if timer is not None:
                timer.cancel()
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

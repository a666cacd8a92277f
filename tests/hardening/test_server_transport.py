"""The server's transport and policy over real sockets: request heads past their limits get 414 or 431
(whole in one read, in pieces, or pipelined behind a good request), a body refused unread gets its 413
read by the client instead of a reset (lingering close, bounded), a loopback server answers only
loopback Host names and the allowed ones (DNS rebinding), error messages name files relative to the
models directory, and start-up settings that would refuse every request are refused at start. During
and after each hostile request, /v1/health answers and a good request is served."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from onnx import TensorProto, helper, save

from soma_runtime.errors import RequestError
from soma_runtime.server import serve
from soma_runtime.server.registry import ModelRegistry
from soma_runtime.server.security import LINGER_BYTES, MAX_HEAD_BYTES, MAX_TARGET_BYTES, Policy
from tests.server.conftest import UnixConnection, free_port

RUN = {"model": "relu", "inputs": {"x": [-1.0, 2.0]}}
ALLOWED = "api.example"
SERVE = ("import json, sys\nfrom soma_runtime.server import serve\nfrom soma_runtime.server.security import Policy\n"
         "kwargs = json.loads(sys.argv[1])\nserve(policy=Policy(**kwargs.pop('policy')), **kwargs)\n")


def onnx_model(path: str, node: str, output_shape: list) -> str:
    """A one-node graph of x (float, N values), its output y declared float."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)
    graph = helper.make_graph([helper.make_node(node, ["x"], ["y"])], node, [x], [y])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


class Server:
    """`serve()` in a subprocess with a graph model `relu` (and `shape`, whose output is declared float: its
    run, building the graph for x's size, finds it i64), stopped through its handle with SIGTERM as a user's
    Ctrl-C would."""

    def __init__(self, models_dir: str, uds: str | None = None, **policy):
        self.port, self.uds = free_port(), uds
        relu = onnx_model(os.path.join(models_dir, "relu.onnx"), "Relu", ["N"])
        shape = onnx_model(os.path.join(models_dir, "shape.onnx"), "Shape", [2])
        kwargs = {"models": [f"relu={relu}", f"shape={shape}"], "port": self.port, "uds": uds, "models_dir": models_dir,
                  "backend": "cpu", "policy": policy}
        self.log = os.path.join(tempfile.mkdtemp(prefix="soma-serve-"), "server.log")
        with open(self.log, "w") as log:                  # the child keeps its own handle
            self.proc = subprocess.Popen([sys.executable, "-c", SERVE, json.dumps(kwargs)], stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self.request("GET", "/v1/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the server did not come up (exit {self.stop()}):\n{self.output()}")

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()

    def connection(self) -> http.client.HTTPConnection:
        return UnixConnection(self.uds) if self.uds else http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
        conn = self.connection()
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def raw(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2**16)        # the kernel takes little of a body for us
        return s

    def serving(self) -> None:
        """/v1/health answers and a good request gets its answer."""
        assert self.request("GET", "/v1/health")[0] == 200
        assert self.request("POST", "/v1/run", RUN) == (200, {"object": "run", "model": "relu", "outputs": {"y": [0.0, 2.0]}})

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(models_dir):
    served = Server(models_dir, allowed_hosts=[ALLOWED])
    yield served
    assert served.stop() == 0, served.output()


def answer(s: socket.socket) -> bytes:
    """What the server sends until it closes (a reset after its answer is its answer too)."""
    received = b""
    try:
        while chunk := s.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def head(target: str = "/v1/health", header_bytes: int = 0, method: str = "GET", extra: str = "") -> bytes:
    filler = "".join(f"X-Filler-{i}: {'f' * 1000}\r\n" for i in range(header_bytes // 1014))
    return f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{filler}{extra}\r\n".encode()


HEADS = {"a 100 KB request line": (head("/v1/health?" + "a" * 100_000), 414),
         "a 9 KB request target": (head("/v1/health?" + "a" * MAX_TARGET_BYTES), 414),
         "70 KB of headers": (head(header_bytes=70_000), 431)}


@pytest.mark.parametrize("pieces", [1, 40], ids=["whole", "in-pieces"])
@pytest.mark.parametrize("name", HEADS)
def test_a_request_head_past_its_limit_is_refused_with_414_or_431(server, name, pieces):
    data, status = HEADS[name]
    with server.raw() as s:
        step = -(-len(data) // pieces)
        for i in range(0, len(data), step):
            s.sendall(data[i:i + step])
            if pieces > 1:
                time.sleep(0.005)
        reply = answer(s)
    assert reply.startswith(b"HTTP/1.1 %d " % status), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
    server.serving()


def test_a_head_just_under_the_limit_is_served(server):
    data = head(header_bytes=MAX_HEAD_BYTES - 2000)
    assert len(data) < MAX_HEAD_BYTES
    with server.raw() as s:
        s.sendall(data.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        assert answer(s).startswith(b"HTTP/1.1 200")


def test_an_oversized_head_pipelined_behind_a_good_request_is_refused(server):
    with server.raw() as s:
        s.sendall(head() + head(header_bytes=70_000))
        reply = answer(s)
    assert reply.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 431 " in reply, reply[:300]
    server.serving()


def post_unread(server, path: str, content_type: str, length: int, chunked: bool) -> tuple[int, dict]:
    """POST a body of `length` bytes the server refuses unread; the status and error the client reads."""
    block = b"0" * 2**20

    def body():
        for start in range(0, length, len(block)):
            yield block[:length - start]
    conn = server.connection()
    try:
        headers = {"Content-Type": content_type, **({} if chunked else {"Content-Length": str(length)})}
        conn.request("POST", path, body(), headers)                 # without a length, http.client chunks it
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path, content_type, limit", [
    ("/v1/run", "application/json", Policy.max_body_bytes),
    ("/v1/audio/transcriptions", "multipart/form-data; boundary=x", Policy.max_upload_bytes),
])
def test_a_body_past_the_limit_gets_its_413_read_not_a_reset(server, path, content_type, limit, chunked):
    status, error = post_unread(server, path, content_type, limit + 1, chunked)
    assert status == 413 and str(limit) in error["error"]["message"]
    server.serving()


def test_a_body_refused_on_its_head_is_answered_while_the_client_still_sends(server):
    with server.raw() as s:
        s.sendall(head("/v1/run", method="POST", extra=f"Content-Type: application/json\r\nContent-Length: {2**30}\r\n"))
        for _ in range(16):                               # past what the kernel's buffers hold: the server reads it
            s.sendall(b"0" * 2**20)
            server.serving()                              # meanwhile it serves others
        assert s.recv(65536).startswith(b"HTTP/1.1 413")


def test_a_client_that_keeps_sending_after_its_413_is_cut_off_past_the_linger_bound(server):
    sent, block = 0, b"0" * 2**20
    with server.raw() as s:
        s.sendall(head("/v1/run", method="POST", extra=f"Content-Type: application/json\r\nContent-Length: {2**40}\r\n"))
        with pytest.raises(OSError):                      # reset or broken pipe, once the bound is passed
            while sent < 4 * LINGER_BYTES:
                s.sendall(block)
                sent += len(block)
    assert LINGER_BYTES <= sent < 2 * LINGER_BYTES
    server.serving()


@pytest.mark.parametrize("host, status", [
    ("attacker.example:8000", 421), ("attacker.example", 421), ("127.0.0.1.nip.io", 421), ("localhost.attacker.example", 421),
    ("localhost", 200), ("LOCALHOST:8000", 200), ("127.0.0.1:8000", 200), ("[::1]:8000", 200), ("127.0.0.2", 200),
    (ALLOWED, 200), (f"{ALLOWED}:443", 200), ("API.Example.", 200),
])
def test_a_loopback_server_answers_loopback_and_allowed_host_names_alone(server, host, status):
    for method, path, body in [("GET", "/v1/health", None), ("POST", "/v1/run", RUN), ("GET", "/v1/models", None)]:
        got, reply = server.request(method, path, body, {"Host": host})
        assert got == status, (path, reply)
    if status == 421:
        assert "--allowed-hosts" in reply["error"]["message"]
    server.serving()


def test_a_request_without_a_host_comes_from_no_browser_and_is_served(server):
    with server.raw() as s:
        s.sendall(b"GET /v1/health HTTP/1.0\r\n\r\n")
        assert answer(s).startswith(b"HTTP/1.1 200")


def test_a_unix_socket_server_answers_any_host_name(tmp_path):
    served = Server(str(tmp_path), uds=str(tmp_path / "soma.sock"))
    try:
        assert served.request("POST", "/v1/run", RUN, {"Host": "attacker.example"})[0] == 200
    finally:
        assert served.stop() == 0, served.output()


@pytest.mark.parametrize("bind, uds, allowed, hosts", [
    ("127.0.0.1", None, (), frozenset()), ("::1", None, (), frozenset()), ("localhost", None, (), frozenset()),
    ("127.0.0.1", None, ("a.example", "[fd00::1]:80"), frozenset({"a.example", "fd00::1"})),
    ("127.0.0.1", None, ("*",), None), ("0.0.0.0", None, (), None), ("::", None, (), None), ("10.1.2.3", None, (), None),
    ("0.0.0.0", None, ("a.example",), frozenset({"a.example"})), ("127.0.0.1", "/tmp/x.sock", (), None),
])
def test_the_host_names_answered_follow_the_bind(bind, uds, allowed, hosts):
    assert Policy(allowed_hosts=allowed).hosts(bind, uds) == hosts


def test_a_failed_load_names_the_file_relative_to_the_models_directory(server, models_dir):
    os.makedirs(os.path.join(models_dir, "sub"), exist_ok=True)
    with open(os.path.join(models_dir, "sub", "bad.gguf"), "wb") as f:
        f.write(b"GGUF" + bytes(64))
    status, error = server.request("POST", "/v1/models/load", {"path": "sub/bad.gguf"})
    assert status == 400 and "sub/bad.gguf" in error["error"]["message"], error
    assert models_dir not in error["error"]["message"] and os.path.realpath(models_dir) not in error["error"]["message"]
    server.serving()


def test_a_graph_error_on_v1_run_names_the_model_file_alone(server, models_dir):
    status, error = server.request("POST", "/v1/run", {"model": "shape", "inputs": {"x": [1.0, 2.0, 3.0]}})
    message = error["error"]["message"]
    assert status == 400 and "shape.onnx: output 'y'" in message and "/shape.onnx" not in message, error
    server.serving()


@pytest.mark.parametrize("limits", [{"head_seconds": -1}, {"body_seconds": -5}, {"send_seconds": 0},
                                    {"head_seconds": float("nan")}, {"body_seconds": float("inf")},
                                    {"max_body_bytes": 0}, {"max_upload_bytes": 2.5}, {"api_key": ""},
                                    {"allowed_hosts": "a.example"}, {"allowed_hosts": ("a b",)}])
def test_a_policy_that_would_refuse_every_request_is_refused(limits):
    with pytest.raises(RequestError, match=next(iter(limits)).replace("api_key", "API key")):
        Policy(**limits)


@pytest.mark.parametrize("settings, needle", [
    ({"uds": "/missing/x.sock"}, "/missing does not exist"), ({"uds": "/tmp/" + "x" * 200}, "at most"),
    ({"uds": __file__}, "not a socket"), ({"port": 70000}, "port"), ({"memory_budget": float("nan")}, "memory budget"),
    ({"memory_budget": -1}, "memory budget"), ({"max_connections": 0}, "max_connections"),
])
def test_serve_refuses_a_place_or_budget_it_cannot_use_before_loading(settings, needle, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("loaded a model for a server that cannot start")
    monkeypatch.setattr(ModelRegistry, "load", never)
    with pytest.raises(RequestError, match=needle):
        serve(["default"], backend="cpu", **settings)

"""A `soma-runtime serve` process per test session (and small ones for tests that need other
settings), on loopback; stopped through its own handle with SIGTERM, as a user's Ctrl-C would."""
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

from soma_runtime.tasks import Runtime


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=120)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, uds: str | None = None, env: dict | None = None, key: str | None = None):
        """`key`: the API key this handle's requests send (the server's own comes from `args` or `env`)."""
        self.port, self.uds, self.key = free_port(), uds, key
        self.url = f"http://127.0.0.1:{self.port}"
        where = ["--uds", uds] if uds else ["--port", str(self.port)]
        self.log = os.path.join(tempfile.mkdtemp(prefix="soma-serve-"), "server.log")
        with open(self.log, "w") as log:          # the child keeps its own handle
            self.proc = subprocess.Popen([sys.executable, "-m", "soma_runtime.cli.main", "serve", *where, *args],
                                         stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if self.get("/v1/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not come up:\n{self.output()}")

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
                full: bool = False) -> tuple:
        """(status, JSON or text body), or with `full` (status, body, response headers)."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn = UnixConnection(self.uds) if self.uds else http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {}),
                **(headers or {})}
        try:
            conn.request(method, path, body=data, headers={k: v for k, v in sent.items() if v is not None})
            response = conn.getresponse()
            status, raw, got = response.status, response.read().decode(), dict(response.getheaders())
        finally:
            conn.close()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = raw
        return (status, payload, got) if full else (status, payload)

    def get(self, path: str):
        return self.request("GET", path)

    def post(self, path: str, body):
        return self.request("POST", path, body)

    def metric(self, name: str, model: str = "default") -> float:
        text = self.get("/v1/metrics")[1]
        for line in text.splitlines():
            if line.startswith(f'{name}{{model="{model}"}}'):
                return float(line.split()[-1])
        raise KeyError(name)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def smol():
    """The same model through the Python API: what a request gets alone."""
    return Runtime().load("default", progress=False)

"""A `soma-runtime serve` process per test session (and small ones for tests that need other
settings), on loopback; stopped through its own handle with SIGTERM, as a user's Ctrl-C would."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from soma_runtime.api import Runtime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="soma-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "soma_runtime.cli.main", "serve", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())
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
        with open(self.log.name) as f:
            return f.read()

    def request(self, method: str, path: str, body: bytes | dict | None = None) -> tuple[int, dict | str]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status, raw = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read().decode()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

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
def server():
    s = ServerProcess()
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="session")
def smol():
    """The same model through the Python API: what a request gets alone."""
    return Runtime().load("default", progress=False)

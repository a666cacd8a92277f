"""A soak on loopback: 32 clients at once for about a minute, streaming and not, mixed with malformed and
oversized requests, wrong content types, clients that vanish mid-stream and clients that stall. Every
good request gets the text it gets alone, every bad one its 4xx; afterwards no sequence or KV page is
held and the server's memory is back within 10% of where it started."""
from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time

import pytest

from tests.hardening.test_memory_cycles import rss_mb
from tests.server.conftest import ServerProcess

SOAK_SECONDS = 60
CLIENTS = 32
PROMPTS = ["The capital of France is", "Write a haiku about rain.", "def add(a, b):", "List three colors:",
           "Once upon a time", "1, 2, 3, 4,", "The best way to learn is", "Translate to French: thank you"]
MAX_TOKENS = 16
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def soaked():
    server = ServerProcess("--max-batch", "8", "--ctx", "512", "--max-body-bytes", str(BODY_LIMIT), "--header-timeout", "2",
                           "--body-timeout", "2")
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture(scope="module")
def expected(smol):
    return {p: smol.complete(p, max_tokens=MAX_TOKENS, temperature=0) for p in PROMPTS}


def completion(prompt: str, stream: bool) -> dict:
    return {"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}


def post(port: int, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def streamed_text(raw: bytes) -> str:
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices"))


def good(port, rng, expected):
    return served(port, rng.choice(PROMPTS), rng.random() < 0.5, expected)


def served(port, prompt, stream, expected):
    status, raw = post(port, json.dumps(completion(prompt, stream)).encode())
    text = streamed_text(raw) if stream and status == 200 else json.loads(raw)["choices"][0]["text"] if status == 200 else None
    return status == 200 and text == expected[prompt], (prompt, stream, status, raw[:300])


def malformed(port, rng, expected):
    status, raw = post(port, b'{"model": "default", "prompt": ')
    return status == 400, raw[:200]


def bad_value(port, rng, expected):
    body = {**completion("hi", False), rng.choice(["top_k", "max_tokens", "seed"]): rng.choice([1e40, 2.5, "x", True])}
    status, raw = post(port, json.dumps(body).encode())
    return status == 400, raw[:200]


def oversized(port, rng, expected):
    status, raw = post(port, json.dumps(completion("x" * BODY_LIMIT, False)).encode())
    return status == 413, raw[:200]


def wrong_type(port, rng, expected):
    status, raw = post(port, json.dumps(completion("hi", False)).encode(), "text/plain")
    return status == 415, raw[:200]


def vanishing(port, rng, expected):
    body = json.dumps({**completion(rng.choice(PROMPTS), True), "max_tokens": 200}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=300) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data:" not in received:
            received += s.recv(4096)
    return received.startswith(b"HTTP/1.1 200"), received[:200]


def stalling(port, rng, expected):
    """Half a request, then silence: the server must cut it off (a 408 for a body, a close for a head)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head[: rng.randrange(10, len(head))])
        received = b""
        while chunk := s.recv(4096):
            received += chunk
    return received == b"" or received.startswith(b"HTTP/1.1 408"), received[:200]


ACTIONS = [(good, 10), (malformed, 1), (bad_value, 1), (oversized, 1), (wrong_type, 1), (vanishing, 2), (stalling, 1)]


def test_a_minute_of_mixed_traffic_leaves_every_good_request_served_and_nothing_held(soaked, expected):
    for prompt in PROMPTS:
        for stream in (False, True):
            ok, detail = served(soaked.port, prompt, stream, expected)
            assert ok, detail
    warm = [threading.Thread(target=good, args=(soaked.port, random.Random(i), expected)) for i in range(16)]
    for t in warm:
        t.start()
    for t in warm:
        t.join()
    start_rss = rss_mb(soaked.proc.pid)
    results, deadline = [], time.monotonic() + SOAK_SECONDS
    actions, weights = zip(*ACTIONS)

    def client(seed):
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            action = rng.choices(actions, weights)[0]
            try:
                ok, detail = action(soaked.port, rng, expected)
            except OSError as e:
                ok, detail = False, repr(e)
            results.append((action.__name__, ok, detail))
    clients = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    failures = [r for r in results if not r[1]]
    assert not failures, failures[:5]
    kinds = {name for name, _, _ in results}
    assert kinds == {a.__name__ for a in actions} and sum(name == "good" for name, _, _ in results) >= 50
    settle = time.monotonic() + 60
    while time.monotonic() < settle and (soaked.metric("soma_running_sequences") or soaked.metric("soma_queue_depth")):
        time.sleep(0.2)
    assert soaked.metric("soma_running_sequences") == 0 and soaked.metric("soma_queue_depth") == 0
    assert soaked.metric("soma_kv_pages_in_use") == 0
    assert rss_mb(soaked.proc.pid) <= start_rss * 1.1, (start_rss, rss_mb(soaked.proc.pid))
    assert good(soaked.port, random.Random(1), expected)[0]

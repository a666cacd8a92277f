"""Bad requests get OpenAI error objects with the right status, a client that vanishes mid-stream
frees its KV pages, an overloaded model answers 503, and the server keeps serving throughout."""
from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.conftest import ServerProcess

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


def still_serving(server, smol):
    status, body = server.post("/v1/chat/completions", CHAT)
    assert status == 200
    assert body["choices"][0]["message"]["content"] == smol.chat(CHAT["messages"], stream=False, max_tokens=4, temperature=0)


@pytest.mark.parametrize("body, status, needle", [
    (b'{"model": "default", "messages": [', 400, "not valid JSON"),
    ({**CHAT, "model": "no-such-model"}, 404, "not loaded"),
    ({**CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ({**CHAT, "temperature": 7}, 400, "temperature"),
    ({**CHAT, "messages": []}, 400, "messages"),
    ({"messages": CHAT["messages"]}, 400, "model"),
    ({**CHAT, "messages": [{"role": "user", "content": "hello " * 5000}]}, 400, "does not fit the context"),
])
def test_bad_requests_are_openai_errors(server, smol, body, status, needle):
    got, error = server.post("/v1/chat/completions", body)
    assert got == status, error
    assert needle in error["error"]["message"] and error["error"]["type"]
    still_serving(server, smol)


def test_prompt_over_the_context_says_so(server):
    _, error = server.post("/v1/completions", {"model": "default", "prompt": "hello " * 5000})
    assert error["error"]["code"] == "context_length_exceeded"


def test_unknown_route_and_method(server):
    assert server.get("/v1/nothing")[0] == 404
    assert server.get("/v1/chat/completions")[0] == 405


def test_a_client_that_disconnects_frees_its_pages(server, smol):
    cancelled = server.metric("soma_generation_cancelled_total")
    messages = [{"role": "user", "content": "Tell a long story."}]
    body = json.dumps({**CHAT, "max_tokens": 400, "stream": True, "messages": messages})
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        received = b""
        while b"data:" not in received:           # headers, then the first event: it is streaming; now vanish
            received += s.recv(4096)
    deadline = time.time() + 30
    while server.metric("soma_generation_cancelled_total") == cancelled and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("soma_generation_cancelled_total") == cancelled + 1
    assert server.metric("soma_kv_pages_in_use") == 0
    still_serving(server, smol)


def test_overload_is_503_and_the_rest_are_served():
    small = ServerProcess("--max-batch", "1", "--max-queue", "1", "--ctx", "64")
    try:
        body = {**CHAT, "max_tokens": 40}
        with ThreadPoolExecutor(6) as pool:
            statuses = sorted(status for status, _ in pool.map(lambda _: small.post("/v1/chat/completions", body), range(6)))
        assert statuses[0] == 200 and statuses[-1] == 503, statuses
        assert small.post("/v1/chat/completions", CHAT)[0] == 200
        _, error = small.post("/v1/completions", {"model": "default", "prompt": "one two three " * 30})
        assert error["error"]["code"] == "context_length_exceeded"
    finally:
        assert small.stop() == 0, small.output()

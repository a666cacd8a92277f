"""What one request may cost: bodies past the size limit get 413, heads and bodies that never finish are
cut off, malformed values are 400s (never 500s), a client that leaves stops its generation, and the
server serves everyone else throughout."""
from __future__ import annotations

import json
import socket
import time

import pytest

from tests.server.conftest import ServerProcess

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
LIMIT = 100_000


@pytest.fixture(scope="module")
def tight():
    server = ServerProcess("--max-body-bytes", str(LIMIT), "--header-timeout", "1.5", "--body-timeout", "1.5", "--ctx", "256")
    yield server
    assert server.stop() == 0, server.output()


def nested(depth: int) -> list:
    value = [1]
    for _ in range(depth):
        value = [value]
    return value


def still_serving(server, smol):
    status, body = server.post("/v1/chat/completions", CHAT)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == smol.chat(CHAT["messages"], stream=False, max_tokens=4, temperature=0)


def exchange(port: int, data: bytes, wait: float = 10) -> bytes:
    """Send raw bytes, then read until the server closes the connection (or `wait` passes)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(wait)
        s.sendall(data)
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except TimeoutError:
            return received + b"<still open>"
        return received


def test_a_body_past_the_limit_is_413(tight, smol):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * LIMIT}]}
    status, error = tight.post("/v1/chat/completions", big)
    assert status == 413 and str(LIMIT) in error["error"]["message"]
    body = json.dumps(big).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 8192]), body[i:i + 8192]) for i in range(0, len(body), 8192))
    reply = exchange(tight.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413")
    still_serving(tight, smol)


def test_a_head_that_never_finishes_is_cut_off(tight, smol):
    start = time.monotonic()
    reply = exchange(tight.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    assert reply == b"" and time.monotonic() - start < 8              # closed by the server, not by our timeout
    still_serving(tight, smol)


def test_a_body_that_never_finishes_is_408(tight, smol):
    reply = exchange(tight.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 5000\r\n\r\n{\"model\": ")
    assert reply.startswith(b"HTTP/1.1 408")
    still_serving(tight, smol)


def whole_response(s: socket.socket) -> bytes:
    """One HTTP response read to its end (its head, then Content-Length bytes of body: they may come apart)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_keep_alive_connection_that_stalls_mid_head_is_cut_off(tight):
    with socket.create_connection(("127.0.0.1", tight.port)) as s:
        s.settimeout(10)
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert whole_response(s).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHo")                   # the next request stalls
        start = time.monotonic()
        assert s.recv(65536) == b"" and time.monotonic() - start < 8


@pytest.mark.parametrize("raw, needle", [
    (json.dumps({**CHAT, "top_k": 1e40}), "top_k"),
    (json.dumps({**CHAT, "top_k": 2**40}), "top_k"),
    (json.dumps({**CHAT, "seed": 2**70}), "seed"),
    (json.dumps({**CHAT, "max_tokens": True}), "max_tokens"),
    (json.dumps({**CHAT, "max_tokens": 2.5}), "max_tokens"),
    (json.dumps({**CHAT, "temperature": "hot"}), "temperature"),
    (json.dumps({**CHAT, "stop": ["x"] * 100}), "stop"),
    (json.dumps({**CHAT, "stop": ["y" * 5000]}), "stop"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": "\ud800 lone"}]}), "Unicode"),
    (json.dumps({"model": "default", "prompt": "bad \udfff", "max_tokens": 2}), "Unicode"),
    ("[" * 100_000 + "]" * 100_000, "JSON"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": "x", "extra": nested(70)}]}), "deeper"),
    ('{"model": "default", "prompt": [1, 2, 99999999], "max_tokens": 2}', "token ids"),
    ('{"model": "default", "prompt": [1, 2.5], "max_tokens": 2}', "prompt"),
])
def test_malformed_values_are_400s(server, smol, raw, needle):
    route = "/v1/completions" if '"prompt"' in raw else "/v1/chat/completions"
    status, error = server.post(route, raw.encode())
    assert status == 400, error
    assert needle in error["error"]["message"], error
    still_serving(server, smol)


def test_seed_minus_one_is_unseeded_as_in_llama_cpp(server, smol):
    for _ in range(2):
        status, body = server.post("/v1/chat/completions", {**CHAT, "seed": -1, "temperature": 0.8, "max_tokens": 6})
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    still_serving(server, smol)


def test_max_tokens_past_the_context_is_cut_to_it(server, smol):
    ids = smol.tokenize("1, 2, 3,")
    assert smol.request(ids, 10**12).max_tokens == smol.engine.n_ctx - len(ids)
    status, body = server.post("/v1/completions", {"model": "default", "prompt": "1, 2, 3,", "max_tokens": 10**12,
                                                  "temperature": 0, "stop": ["7"]})
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
    still_serving(server, smol)


def test_a_prompt_too_long_by_its_characters_alone_is_refused_untokenized(smol, monkeypatch):
    from soma_runtime.errors import PromptTooLong

    def never(*args, **kwargs):
        raise AssertionError("tokenized a prompt that could not fit")
    bound = smol.engine.n_ctx * smol.tokenizer.max_token_chars
    monkeypatch.setattr(smol.tokenizer.hf, "encode", never)
    with pytest.raises(PromptTooLong, match="characters"):
        smol.generate("a" * (bound + 1))
    with pytest.raises(PromptTooLong, match="characters"):
        smol.chat_ids([{"role": "user", "content": "a" * (bound + 1)}])


def test_a_non_streaming_client_that_leaves_stops_its_generation(server, smol):
    cancelled = server.metric("soma_generation_cancelled_total")
    generated = server.metric("soma_generated_tokens_total")
    body = json.dumps({**CHAT, "max_tokens": 2000, "messages": [{"role": "user", "content": "Tell a very long story."}],
                       "stop": ["never-said"]})
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.time() + 60
        while server.metric("soma_generated_tokens_total") < generated + 5 and time.time() < deadline:
            time.sleep(0.05)                              # it is generating; now vanish
    deadline = time.time() + 30
    while server.metric("soma_generation_cancelled_total") == cancelled and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("soma_generation_cancelled_total") == cancelled + 1
    assert server.metric("soma_kv_pages_in_use") == 0
    assert server.metric("soma_generated_tokens_total") < generated + 1000
    still_serving(server, smol)

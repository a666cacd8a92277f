"""Encoder routes on a server listening on a unix socket: /v1/embeddings and /v1/classifications
give what the Python API gives; a generator route on an encoder is a clear 400."""
from __future__ import annotations

import base64
import os

import numpy as np
import pytest

from soma_runtime.tasks import Runtime
from tests.server.conftest import ServerProcess

TEXTS = ["A man is eating food.", "The new movie is awesome.", "A cheetah runs behind its prey."]


@pytest.fixture(scope="module")
def uds_server(tmp_path_factory):
    s = ServerProcess("--model", "mini=minilm", uds=os.path.join(tmp_path_factory.mktemp("sock"), "soma.sock"))
    yield s
    assert s.stop() == 0, s.output()


def test_embeddings_over_a_unix_socket(uds_server):
    expected = Runtime().load("minilm", progress=False).embed(TEXTS)
    status, body = uds_server.post("/v1/embeddings", {"model": "mini", "input": TEXTS})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose(np.array([d["embedding"] for d in body["data"]]), expected, atol=1e-6)
    assert body["usage"]["prompt_tokens"] > len(TEXTS)
    _, packed = uds_server.post("/v1/embeddings", {"model": "mini", "input": TEXTS[0], "encoding_format": "base64"})
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), np.float32), expected[0],
                               atol=1e-6)


def test_embedding_dimensions_truncate_and_renormalize(uds_server):
    full = np.array(uds_server.post("/v1/embeddings", {"model": "mini", "input": TEXTS[1]})[1]["data"][0]["embedding"])
    status, body = uds_server.post("/v1/embeddings", {"model": "mini", "input": TEXTS[1], "dimensions": 64})
    short = np.array(body["data"][0]["embedding"])
    assert status == 200 and short.shape == (64,)
    np.testing.assert_allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)
    assert uds_server.post("/v1/embeddings", {"model": "mini", "input": "x", "dimensions": 1000})[0] == 400


def test_encoder_errors(uds_server):
    assert uds_server.post("/v1/chat/completions", {"model": "mini", "messages": [{"role": "user", "content": "hi"}]})[0] == 400
    status, error = uds_server.post("/v1/classifications", {"model": "mini", "input": "text", "labels": ["a", "b"]})
    assert status == 400 and "NLI" in error["error"]["message"]
    assert uds_server.post("/v1/embeddings", {"model": "mini", "input": []})[0] == 400

"""Who may use a server, and which files it may load: the API key on every route but health, JSON
bodies only, CORS for the listed origins alone, model management off unless asked for and then
confined to the models directory, model ids that cannot forge metrics lines."""
from __future__ import annotations

import json
import os
import socket

import pytest

from tests.server.conftest import ServerProcess

KEY = "s3cret-key"
ORIGIN = "https://app.example"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(models_dir, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.gguf").write_bytes(b"GGUF" + bytes(64))
    os.symlink(outside, os.path.join(models_dir, "escape"))
    server = ServerProcess("--api-key", KEY, "--allow-model-management", "--models-dir", models_dir,
                           "--allowed-origins", ORIGIN, "--ctx", "256", key=KEY)
    server.outside = str(outside)
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture(scope="module")
def plain():
    """Defaults, with the key from the environment: model management is off."""
    server = ServerProcess("--ctx", "128", env={"SOMA_API_KEY": KEY}, key=KEY)
    yield server
    assert server.stop() == 0, server.output()


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {KEY}", KEY, "Bearer"])
def test_every_route_but_health_needs_the_key(guarded, authorization):
    for method, path, body in [("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None),
                               ("GET", "/v1/metrics", None), ("POST", "/v1/models/load", {"path": "smollm2.gguf"}),
                               ("DELETE", "/v1/models/default", None), ("GET", "/v1/nothing", None),
                               ("GET", "/v1/lora-adapters", None), ("POST", "/v1/lora-adapters", {"path": "adapter"})]:
        status, error, headers = guarded.request(method, path, body, {"Authorization": authorization}, full=True)
        assert status == 401 and error["error"]["type"] == "authentication_error", (path, status, error)
        assert headers["www-authenticate"] == "Bearer"
    assert guarded.request("GET", "/v1/health", headers={"Authorization": authorization})[0] == 200
    assert guarded.post("/v1/chat/completions", CHAT)[0] == 200


def test_the_key_can_come_from_the_environment(plain):
    assert plain.request("GET", "/v1/models", headers={"Authorization": None})[0] == 401
    assert plain.get("/v1/models")[0] == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None, "application/jsonp"])
def test_bodies_must_be_sent_as_json(guarded, content_type):
    status, error = guarded.request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), {"Content-Type": content_type})
    assert status == 415 and "application/json" in error["error"]["message"]
    assert guarded.request("POST", "/v1/chat/completions", CHAT, {"Content-Type": "application/json; charset=utf-8"})[0] == 200


def test_cors_answers_the_allowed_origin_alone(guarded, plain):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    status, _, headers = guarded.request("OPTIONS", "/v1/chat/completions", headers=preflight, full=True)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, _, headers = guarded.request("OPTIONS", "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"},
                                         full=True)
    assert status == 400 and "access-control-allow-origin" not in headers
    _, _, headers = guarded.request("GET", "/v1/models", headers={"Origin": "https://evil.example"}, full=True)
    assert "access-control-allow-origin" not in headers
    _, _, headers = plain.request("GET", "/v1/models", headers={"Origin": ORIGIN}, full=True)       # default: no origin at all
    assert "access-control-allow-origin" not in headers


def test_model_management_is_off_by_default(plain):
    status, error = plain.post("/v1/models/load", {"path": "/tmp"})
    assert status == 403 and "--allow-model-management" in error["error"]["message"]
    assert plain.request("DELETE", "/v1/models/default")[0] == 403
    for body in ({"path": "/tmp"}, {"action": "unload", "name": "any"}):
        status, error = plain.post("/v1/lora-adapters", body)
        assert status == 403 and "--allow-model-management" in error["error"]["message"]
    assert plain.get("/v1/lora-adapters") == (200, {"object": "list", "data": []})
    assert [m["id"] for m in plain.get("/v1/models")[1]["data"]] == ["default"]


def test_loads_never_leave_the_models_directory_nor_say_what_lies_outside(guarded):
    answers = {path: guarded.post("/v1/models/load", {"path": path, "id": "x"})
               for path in ["../outside/secret.gguf", os.path.join(guarded.outside, "secret.gguf"), "/etc/passwd",
                            "/no/such/file.gguf", "escape/secret.gguf", "escape", "..", ".", ""]}
    assert {status for status, _ in answers.values()} == {403}, answers
    assert len({json.dumps(body) for _, body in answers.values()}) == 1, answers     # one answer, whatever exists
    assert guarded.post("/v1/models/load", {"path": "nothing-here.gguf"})[0] == 404
    adapters = {path: guarded.post("/v1/lora-adapters", {"path": path}) for path in answers}
    assert {status for status, _ in adapters.values()} == {403}, adapters
    assert {json.dumps(body) for _, body in adapters.values()} == {json.dumps(body) for _, body in answers.values()}
    assert [m["id"] for m in guarded.get("/v1/models")[1]["data"]] == ["default"]


def test_a_load_from_the_models_directory_checks_its_sha256(guarded, models_dir):
    import hashlib
    with open(os.path.join(models_dir, "smollm2.gguf"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    status, error = guarded.post("/v1/models/load", {"path": "smollm2.gguf", "id": "pinned", "sha256": "0" * 64})
    assert status == 400 and "does not match" in error["error"]["message"]
    status, card = guarded.post("/v1/models/load", {"path": "smollm2.gguf", "id": "pinned", "sha256": digest})
    assert status == 200 and card["id"] == "pinned"
    assert guarded.request("DELETE", "/v1/models/pinned")[0] == 200


def test_model_listings_show_ids_not_paths(guarded, models_dir):
    listing = json.dumps(guarded.get("/v1/models")[1]) + json.dumps(guarded.get("/v1/models/default")[1])
    assert models_dir not in listing and "/" not in listing.replace("\\/", "")


@pytest.mark.parametrize("model_id", ["evil\nsoma_forged_total 1", 'quote"d', "x" * 65, "a b", ""])
def test_model_ids_that_could_forge_metrics_lines_are_refused(guarded, model_id):
    status, error = guarded.post("/v1/models/load", {"path": "smollm2.gguf", "id": model_id})
    assert status == 400 and "model id" in error["error"]["message"]
    assert "soma_forged_total" not in guarded.get("/v1/metrics")[1]


def test_metrics_label_values_are_escaped():
    from soma_runtime.server.metrics import label
    assert label(model='a"b\\c\nd') == '{model="a\\"b\\\\c\\nd"}'


def test_a_refused_request_leaves_the_server_serving(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:           # not even HTTP
        s.sendall(b"\x16\x03\x01garbage\r\n\r\n")
        s.recv(1024)
    assert guarded.post("/v1/chat/completions", CHAT)[0] == 200

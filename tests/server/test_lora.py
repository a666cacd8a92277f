"""LoRA adapters through `soma-runtime serve`: `--lora PATH[:SCALE]` at start, a request picking one by model
name `base:adapter` or a `lora` field with a scale, `/v1/lora-adapters` loading, listing and unloading at
run time from the models directory; greedy replies equal PEFT's, bad requests are 4xx naming what is wrong
and the server runs on."""
from __future__ import annotations

import json

import pytest

from tests.fixtures.adapters import make_adapter
from tests.fixtures.decoders import build_model, hf_greedy
from tests.server.conftest import ServerProcess

PROMPT = "The quick brown fox jumps over the lazy dog. Hello world 123!"
STEPS = 8
ADAPTERS = {"qv-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "dora-r4": {"r": 4, "lora_alpha": 8, "use_dora": True, "target_modules": ["q_proj", "down_proj"]},
            "rank-0": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
            "mlp-r16": {"r": 16, "lora_alpha": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
            "wide-r32": {"r": 32, "lora_alpha": 32, "target_modules": ["gate_proj", "up_proj"]}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    base, tok = build_model("llama", str(root / "base"))
    peft = {name: make_adapter(base, cfg, str(root / name), seed) for seed, (name, cfg) in enumerate(ADAPTERS.items())}
    config = root / "rank-0" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "r": 0}))
    server = ServerProcess("--model", f"tiny={root / 'base'}", "--backend", "cpu", "--lora", f"{root / 'qv-r4'}:1",
                           "--allow-model-management", "--models-dir", str(root))
    yield server, base, peft, tok, root
    server.stop()


def completion(server, model: str, tok, **fields) -> tuple[int, dict]:
    return server.post("/v1/completions", {"model": model, "prompt": tok.encode(PROMPT).ids, "max_tokens": STEPS,
                                           "temperature": 0, "ignore_eos": True, **fields})


def same_text(reply: dict, reference, tok) -> None:
    """The reply's text is the reference model's greedy continuation, up to its first near-tie."""
    want, clear = hf_greedy(reference, tok.encode(PROMPT).ids, STEPS)
    assert clear >= 4, "a near-tie in the reference's first steps: reseed the adapter"
    text = tok.decode(want[:clear]).rstrip("\ufffd")       # a character whose bytes are not all out yet is held back
    assert text and reply["choices"][0]["text"].startswith(text)


def test_the_model_name_base_colon_adapter_runs_the_adapter_as_peft_does(setup):
    server, base, peft, tok, _ = setup
    status, reply = completion(server, "tiny:qv-r4", tok)
    assert status == 200, reply
    same_text(reply, peft["qv-r4"], tok)
    base_text = tok.decode(hf_greedy(base, tok.encode(PROMPT).ids, STEPS)[0])
    assert reply["choices"][0]["text"] != base_text, "the adapter changes nothing"


def test_the_lora_field_with_a_scale_runs_the_adapter_at_that_scale(setup, tmp_path):
    import copy

    from peft import PeftModel
    server, base, _, tok, root = setup
    halved = tmp_path / "halved"
    halved.mkdir()
    (halved / "adapter_model.safetensors").write_bytes((root / "qv-r4" / "adapter_model.safetensors").read_bytes())
    config = json.loads((root / "qv-r4" / "adapter_config.json").read_text())
    (halved / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": config["lora_alpha"] / 2}))
    status, reply = completion(server, "tiny", tok, lora={"name": "qv-r4", "scale": 0.5})
    assert status == 200, reply
    same_text(reply, PeftModel.from_pretrained(copy.deepcopy(base), str(halved)).eval(), tok)
    status, reply = completion(server, "tiny", tok)
    assert status == 200, reply
    same_text(reply, base, tok)


def test_adapters_load_list_and_unload_at_run_time(setup):
    server, _, peft, tok, _ = setup
    held = server.get("/v1/models/tiny")[1]["memory_bytes"]
    status, card = server.post("/v1/lora-adapters", {"model": "tiny", "path": "dora-r4", "alpha": 1.0})
    assert status == 200, card
    assert card["id"] == "tiny:dora-r4" and card["rank"] == 4 and "source" not in card
    assert server.get("/v1/models/tiny")[1]["memory_bytes"] == held     # its slot (of 8, at rank 4) was held already
    listed = [c["id"] for c in server.get("/v1/models")[1]["data"]]
    assert "tiny:dora-r4" in listed and "tiny:qv-r4" in listed
    status, reply = completion(server, "tiny:dora-r4", tok)
    assert status == 200, reply
    same_text(reply, peft["dora-r4"], tok)
    status, _ = server.post("/v1/lora-adapters", {"action": "unload", "model": "tiny", "name": "dora-r4"})
    assert status == 200
    assert [c["id"] for c in server.get("/v1/lora-adapters")[1]["data"]] == ["tiny:qv-r4"]
    status, reply = completion(server, "tiny:dora-r4", tok)
    assert status == 400 and "no adapter named 'dora-r4'" in reply["error"]["message"]
    assert server.post("/v1/lora-adapters", {"model": "tiny", "path": "mlp-r16"})[0] == 200
    # every slot of every linear layer widens to rank 16: 8 slots x 12 more ranks x (in + out) f32s
    sizes = {"q": (64, 64), "k": (64, 32), "v": (64, 32), "o": (64, 64), "gate": (64, 128), "up": (64, 128), "down": (128, 64)}
    grown = 8 * 12 * 2 * sum(k + n for k, n in sizes.values()) * 4
    assert server.get("/v1/models/tiny")[1]["memory_bytes"] == held + grown
    assert server.post("/v1/lora-adapters", {"action": "unload", "model": "tiny", "name": "mlp-r16"})[0] == 200


@pytest.mark.parametrize("body,status,words", [
    ({"model": "tiny", "path": "../etc"}, 403, "inside the server's models directory"),
    ({"model": "tiny", "path": "qv-r4", "name": ".."}, 400, "adapter name"),
    ({"model": "tiny", "path": "qv-r4"}, 400, "loaded already"),
    ({"model": "tiny", "path": "rank-0"}, 400, "rank must be an integer in [1, 1024], got 0"),
    ({"model": "tiny", "path": "no-such"}, 404, "no adapter 'no-such'"),
    ({"model": "tiny", "path": "base"}, 400, "not a PEFT adapter directory"),
    ({"model": "nobody", "path": "qv-r4"}, 404, "nobody"),
    ({"model": "tiny", "path": "dora-r4", "alpha": "high"}, 400, "alpha"),
    ({"model": "tiny", "action": "unload", "name": "nobody"}, 400, "no adapter named 'nobody'"),
], ids=["dotdot-path", "dotdot-name", "taken", "rank-0", "missing", "not-an-adapter", "no-model", "alpha-text", "unload-unknown"])
def test_bad_adapter_management_is_a_clear_error(setup, body, status, words):
    server = setup[0]
    got, reply = server.post("/v1/lora-adapters", body)
    assert got == status, reply
    assert words in json.dumps(reply)


@pytest.mark.parametrize("model,fields,words", [
    ("tiny", {"lora": "nobody"}, "no adapter named 'nobody'"),
    ("tiny:qv-r4", {"lora": "qv-r4"}, "give one"),
    ("tiny", {"lora": {"name": "qv-r4", "scale": 1e9}}, "lora scale"),
    ("tiny", {"lora": {"name": "qv-r4", "strength": 1}}, "strength"),
    ("nobody:qv-r4", {}, "nobody:qv-r4"),
], ids=["unknown", "twice", "huge-scale", "unknown-field", "unknown-base"])
def test_bad_adapter_requests_are_clear_errors(setup, model, fields, words):
    server, _, _, tok, _ = setup
    status, reply = completion(server, model, tok, **fields)
    assert status in (400, 404), reply
    assert words in json.dumps(reply)


def test_a_nan_scale_is_refused(setup):
    server, tok = setup[0], setup[3]
    raw = json.dumps({"model": "tiny", "prompt": tok.encode(PROMPT).ids, "max_tokens": 2,
                      "lora": {"name": "qv-r4", "scale": 0.5}})
    status, reply = server.request("POST", "/v1/completions", raw.replace("0.5", "NaN").encode())
    assert status == 400 and "lora scale" in json.dumps(reply)


def test_a_flood_of_load_requests_is_refused_and_the_server_runs_on(setup):
    """Past the 32 adapters a model holds (4 x max_loras 8), every load is a 400 read from no file; then the server
    answers as before."""
    server, _, peft, tok, _ = setup
    held = len(server.get("/v1/lora-adapters")[1]["data"])
    names = [f"extra-{i}" for i in range(32 - held)]
    for name in names:
        assert server.post("/v1/lora-adapters", {"model": "tiny", "path": "qv-r4", "name": name})[0] == 200
    for i in range(500):
        status, reply = server.post("/v1/lora-adapters", {"model": "tiny", "path": "qv-r4", "name": f"flood-{i}"})
        assert status == 400 and "adapters this model holds are loaded" in reply["error"]["message"]
    for name in names:
        assert server.post("/v1/lora-adapters", {"action": "unload", "model": "tiny", "name": name})[0] == 200
    assert server.get("/v1/health")[0] == 200
    status, reply = completion(server, "tiny:qv-r4", tok)
    assert status == 200, reply
    same_text(reply, peft["qv-r4"], tok)


def test_requests_under_adapters_run_on_while_adapters_load_and_unload(setup):
    """Completions under the base and two adapters from 6 threads at once, while another thread loads and
    unloads an adapter of the widest rank yet 10 times (its first load rebuilds the slots' stacks wider as
    steps run): every reply is 200 and the text each gets alone."""
    import threading
    server, _, _, tok, _ = setup
    models = ["tiny", "tiny:qv-r4", "tiny:dora-r4"]
    assert server.post("/v1/lora-adapters", {"model": "tiny", "path": "dora-r4"})[0] == 200
    alone = {m: completion(server, m, tok)[1]["choices"][0]["text"] for m in models}
    assert len(set(alone.values())) == 3
    failures, done = [], threading.Event()

    def churn():
        for _ in range(10):
            for body in ({"model": "tiny", "path": "wide-r32", "name": "churn"},
                         {"action": "unload", "model": "tiny", "name": "churn"}):
                status, reply = server.post("/v1/lora-adapters", body)
                if status != 200:
                    failures.append(("churn", status, reply))
        done.set()

    def ask(model):
        while not done.is_set():
            status, reply = completion(server, model, tok)
            if status != 200 or reply["choices"][0]["text"] != alone[model]:
                failures.append((model, status, reply))

    threads = [threading.Thread(target=churn)] + [threading.Thread(target=ask, args=(m,)) for m in models * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not failures, failures[:3]
    assert server.post("/v1/lora-adapters", {"action": "unload", "model": "tiny", "name": "dora-r4"})[0] == 200

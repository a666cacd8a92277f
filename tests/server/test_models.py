"""Loading, unloading and hot-swapping models while requests stream: no request is lost."""
from __future__ import annotations

import threading

PROMPT = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


def test_load_unload_and_hot_swap_under_traffic(server, smol):
    expected = smol.complete(PROMPT["prompt"], max_tokens=12, temperature=0)
    results, stop = [], threading.Event()

    def traffic(model):
        while not stop.is_set():
            status, body = server.post("/v1/completions", {**PROMPT, "model": model})
            results.append((model, status, body["choices"][0]["text"] if status == 200 else body))

    workers = [threading.Thread(target=traffic, args=("default",)) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        status, card = server.post("/v1/models/load", {"path": "smollm2.gguf", "id": "second", "priority": 1})
        assert status == 200 and card["id"] == "second"
        assert sorted(m["id"] for m in server.get("/v1/models")[1]["data"]) == ["default", "second"]
        assert server.post("/v1/completions", {**PROMPT, "model": "second"})[1]["choices"][0]["text"] == expected
        assert server.post("/v1/models/load", {"path": "smollm2.gguf", "id": "default"})[0] == 200   # hot-swap while serving
        assert server.request("DELETE", "/v1/models/second")[0] == 200
        assert server.post("/v1/completions", {**PROMPT, "model": "second"})[0] == 404
        assert server.request("DELETE", "/v1/models/second")[0] == 404
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert len(results) >= 3
    assert all(status == 200 and text == expected for _, status, text in results), results
    assert [m["id"] for m in server.get("/v1/models")[1]["data"]] == ["default"]


def test_health_and_metrics(server):
    status, health = server.get("/v1/health")
    assert status == 200 and health["status"] == "ok" and health["models_loaded"] == ["default"]
    assert health["backends"]["cpu"]["available"]
    text = server.get("/v1/metrics")[1]
    for family in ("soma_http_requests_total", "soma_generated_tokens_total", "soma_tokens_per_second", "soma_queue_depth",
                   "soma_kv_pages_in_use", "soma_model_memory_bytes"):
        assert f"# TYPE {family}" in text
    assert server.metric("soma_model_memory_bytes") > 1e8

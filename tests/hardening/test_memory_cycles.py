"""Unloading gives memory back: a server that loads and unloads (or hot-swaps) a model again and again
stays at the memory it had after the first cycles, and its budget counts only what is live."""
from __future__ import annotations

import time

PROMPT = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def cycle(server, swap: bool) -> None:
    assert server.post("/v1/models/load", {"path": "smollm2.gguf", "id": "cycled"})[0] == 200
    assert server.post("/v1/completions", {**PROMPT, "model": "cycled"})[0] == 200
    if swap:
        assert server.post("/v1/models/load", {"path": "smollm2.gguf", "id": "cycled"})[0] == 200
        assert server.post("/v1/completions", {**PROMPT, "model": "cycled"})[0] == 200
    assert server.request("DELETE", "/v1/models/cycled")[0] == 200


def test_load_unload_and_hot_swap_cycles_give_memory_back(server):
    for _ in range(2):                                     # allocator and kernel caches warm up
        cycle(server, swap=True)
    settled = rss_mb(server.proc.pid)
    for _ in range(6):
        cycle(server, swap=True)
    assert rss_mb(server.proc.pid) < settled * 1.1 + 50, (settled, rss_mb(server.proc.pid))
    deadline = time.time() + 30                 # an unloaded model drains on a thread of its own, then leaves the count
    while server.get("/v1/health")[1]["memory"]["models_bytes"] != server.metric("soma_model_memory_bytes") \
            and time.time() < deadline:
        time.sleep(0.1)
    assert server.get("/v1/health")[1]["memory"]["models_bytes"] == server.metric("soma_model_memory_bytes")

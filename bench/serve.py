"""Serving throughput and time to first token: ours vs llama-cpp-python's server, same GGUF, same run.

At 1, 4 and 16 concurrent streaming clients (2 requests each, 64 new tokens, greedy, chat prompts
that differ per client), through the official `openai` client: generated tok/s over the wall time
of each level, and p50/p99 time to the first content token. Each server runs alone on the machine
with 2 threads (llama-cpp-python: `python -m llama_cpp.server`, chatml).
Run: python bench/serve.py [--threads 2] [--clients 1 4 16]; JSON goes to bench/out/serve.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai

OUT = Path(__file__).parent / "out"
TOPICS = ["the sea", "a cat", "mountains", "coffee", "the moon", "rain", "a library", "trains", "autumn", "bees",
          "a lighthouse", "snow", "bread", "the desert", "a violin", "clocks"]
NEW_TOKENS = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], port: int, log_path: str) -> subprocess.Popen:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[:4]} exited: {Path(log_path).read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{command[:4]} did not come up")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def one_request(client, model: str, client_id: int, round_: int) -> tuple[float, int]:
    """(seconds to the first content token, completion tokens) of one streamed chat request."""
    topic = TOPICS[(client_id + round_ * 7) % len(TOPICS)]
    messages = [{"role": "user", "content": f"Write a short story about {topic}."}]
    start, first, tokens = time.perf_counter(), None, 0
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                                                stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            tokens += 1                      # one content chunk per token on both servers
            if first is None:
                first = time.perf_counter() - start
    return first if first is not None else float("nan"), tokens


def level(url: str, model: str, clients: int) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def client_run(i):
        return [one_request(client, model, i, r) for r in range(2)]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = [r for rs in pool.map(client_run, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    ttft = np.array([t for t, _ in runs])
    tokens = sum(n for _, n in runs)
    return {"clients": clients, "requests": len(runs), "tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "ttft_p50_s": float(np.nanpercentile(ttft, 50)), "ttft_p99_s": float(np.nanpercentile(ttft, 99)),
            "empty_responses": int(np.isnan(ttft).sum())}


def run_server(name: str, command: list[str], port: int, model: str, levels: list[int]) -> list[dict]:
    proc = start(command, port, os.path.join(tempfile.mkdtemp(), f"{name}.log"))
    try:
        level(f"http://127.0.0.1:{port}", model, 1)          # warm-up: plans, caches
        results = []
        for clients in levels:
            results.append(level(f"http://127.0.0.1:{port}", model, clients))
            r = results[-1]
            print(f"  {name:18s} {clients:2d} clients: {r['tok_s']:7.1f} tok/s  ttft p50 {r['ttft_p50_s']:.2f} s  "
                  f"p99 {r['ttft_p99_s']:.2f} s  ({r['tokens']} tokens, {r['empty_responses']} empty responses)", flush=True)
        return results
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    from soma_runtime.loaders import default_model_path
    path = default_model_path()
    ours_port, peer_port = free_port(), free_port()
    ours = [sys.executable, "-m", "soma_runtime.cli.main", "serve", "--model", f"smollm2={path}", "--port", str(ours_port),
            "--threads", str(args.threads), "--ctx", "2048"]
    peer = [sys.executable, "-m", "llama_cpp.server", "--model", path, "--model_alias", "smollm2", "--port", str(peer_port),
            "--n_threads", str(args.threads), "--n_ctx", "2048", "--chat_format", "chatml", "--verbose", "False",
            "--interrupt_requests", "False"]               # queue concurrent requests instead of cutting the running one off
    print(f"SmolLM2 ({Path(path).name}), {NEW_TOKENS} tokens per request, 2 requests per client, {args.threads} threads")
    results = {"ours": run_server("soma-runtime", ours, ours_port, "smollm2", args.clients),
               "llama-cpp-python": run_server("llama-cpp-python", peer, peer_port, "smollm2", args.clients)}
    print(f"\n{'clients':>7} {'ours tok/s':>11} {'peer tok/s':>11} {'ratio':>6} {'ours p99 ttft':>14} {'peer p99 ttft':>14}")
    for mine, theirs in zip(results["ours"], results["llama-cpp-python"]):
        print(f"{mine['clients']:7d} {mine['tok_s']:11.1f} {theirs['tok_s']:11.1f} {mine['tok_s'] / theirs['tok_s']:5.2f}x "
              f"{mine['ttft_p99_s']:13.2f}s {theirs['ttft_p99_s']:13.2f}s")
    OUT.mkdir(exist_ok=True)
    (OUT / "serve.json").write_text(json.dumps({"model": Path(path).name, "threads": args.threads, **results}, indent=2))


if __name__ == "__main__":
    main()

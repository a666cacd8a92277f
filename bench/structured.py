"""Grammar overhead: decode tok/s with and without a JSON schema on SmolLM2 (CPU), ours vs llama-cpp-python.

Batch 1 in the library: ours (`generate(..., json_schema=...)`) and llama-cpp-python's
`create_chat_completion(response_format={"type": "json_object", "schema": ...})` on the same GGUF and
schema, each in a process of its own, alternating over rounds (median). Decode tok/s is taken from the
first streamed token to the last. Through our server: 1 and 16 concurrent clients, with and without the
schema. Also our mask time per token (mean, p99). The schema fixes the reply's shape (12 items), so both
engines write about the same number of tokens; the plain runs write as many.
Run: python bench/structured.py [--threads 2] [--rounds 3]; JSON goes to bench/out/structured.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from serve import free_port, start, stop
from workers import median_of, run_worker

OUT = Path(__file__).parent / "out"
ITEM = {"type": "object", "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 10},
                                         "score": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["name", "score"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"players": {"type": "array", "items": ITEM, "minItems": 12, "maxItems": 12}},
          "required": ["players"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "List twelve players of a game with their scores, as JSON."}]
PLAIN_TOKENS = 240           # about what the schema's reply takes: decode slows as the context grows
PAIRS = 3                    # plain and constrained runs alternate within a worker (the machine's speed drifts)


def decode_rate(stamps: list[float]) -> float:
    """Tokens per second from the first streamed token to the last."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def ours_worker(threads: int) -> dict:
    from soma_runtime.tasks import Runtime
    model = Runtime("cpu", threads=threads).load("default", progress=False)

    def timed(**params) -> tuple[list[float], str]:
        stamps, text = [], ""
        for token in model.chat(MESSAGES, temperature=0, **params):
            stamps.append(time.perf_counter())
            text += token.text
        return stamps, text

    timed(json_schema=SCHEMA, max_tokens=400)                       # warm-up: plans, the grammar's first compile
    return alternate(lambda: timed(max_tokens=PLAIN_TOKENS, ignore_eos=True), lambda: timed(json_schema=SCHEMA, max_tokens=400),
                     model.metrics)


def alternate(plain, held, metrics=None) -> dict:
    """Median rates over PAIRS of (plain, constrained) runs, and the median of each pair's overhead."""
    rates, mask = [], []
    for _ in range(PAIRS):
        plain_stamps, _ = plain()
        held_stamps, text = held()
        json.loads(text)
        rates.append((decode_rate(plain_stamps), decode_rate(held_stamps)))
        if metrics is not None:
            mask.append((metrics()["mask_ms_mean"], metrics()["mask_ms_p99"]))
    out = {"plain_tok_s": float(np.median([p for p, _ in rates])), "schema_tok_s": float(np.median([h for _, h in rates])),
           "overhead": float(np.median([1 - h / p for p, h in rates])), "schema_tokens": len(held_stamps)}
    if mask:
        out.update(mask_ms_mean=float(np.median([m for m, _ in mask])), mask_ms_p99=float(np.median([p for _, p in mask])))
    return out


def peer_worker(threads: int) -> dict:
    from llama_cpp import Llama

    from soma_runtime.loaders import default_model_path
    llm = Llama(default_model_path(), n_threads=threads, n_ctx=2048, chat_format="chatml", verbose=False)

    def timed(**params) -> tuple[list[float], str]:
        stamps, text = [], ""
        for chunk in llm.create_chat_completion(MESSAGES, temperature=0, stream=True, **params):
            piece = chunk["choices"][0]["delta"].get("content")
            if piece:
                stamps.append(time.perf_counter())
                text += piece
        return stamps, text

    fmt = {"type": "json_object", "schema": SCHEMA}
    timed(response_format=fmt, max_tokens=400)
    return alternate(lambda: timed(max_tokens=PLAIN_TOKENS, logit_bias={llm.token_eos(): -100.0}),
                     lambda: timed(response_format=fmt, max_tokens=400))


def server_level(url: str, clients: int, schema: bool) -> float:
    """Generated tok/s over the wall time of `clients` concurrent streamed chats (2 each)."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    extra = ({"response_format": {"type": "json_schema", "json_schema": {"name": "players", "schema": SCHEMA}}} if schema
             else {"extra_body": {"ignore_eos": True}})

    def one(i: int) -> int:
        tokens = 0
        for _ in range(2):
            messages = [{"role": "user", "content": MESSAGES[0]["content"] + f" Game {i}."}]
            for chunk in client.chat.completions.create(model="default", messages=messages, temperature=0, stream=True,
                                                        max_tokens=400 if schema else PLAIN_TOKENS, **extra):
                tokens += bool(chunk.choices and chunk.choices[0].delta.content)
        return tokens

    start_s = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(clients)))
    return tokens / (time.perf_counter() - start_s)


def server_figures(threads: int) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "soma_runtime.cli.main", "serve", "--port", str(port), "--threads", str(threads),
               "--ctx", "2048"]
    proc = start(command, port, os.path.join(tempfile.mkdtemp(), "soma.log"))
    url = f"http://127.0.0.1:{port}"
    try:
        server_level(url, 1, True)                   # warm-up
        return {f"server_{clients}_{'schema' if schema else 'plain'}_tok_s": server_level(url, clients, schema)
                for clients in (1, 16) for schema in (False, True)}
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", choices=("ours", "peer"), default=None)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps((ours_worker if args.worker == "ours" else peer_worker)(args.threads)))
        return
    rounds = {"ours": [], "peer": []}
    for r in range(args.rounds):
        for name in ("ours", "peer"):
            rounds[name].append(run_worker(__file__, name, threads=args.threads))
            print(f"round {r + 1} {name}: {rounds[name][-1]}", flush=True)
    ours, peer = median_of(rounds["ours"]), median_of(rounds["peer"])
    server = server_figures(args.threads)
    print(f"\nSmolLM2, {args.threads} threads, batch 1 (library), median of {args.rounds} alternating rounds")
    print(f"{'':24s} {'ours tok/s':>11} {'llama-cpp-python':>17} {'ratio':>6}")
    for key, label in (("plain_tok_s", "no schema"), ("schema_tok_s", "JSON schema")):
        print(f"{label:24s} {ours[key]:11.1f} {peer[key]:17.1f} {ours[key] / peer[key]:5.2f}x")
    print(f"grammar overhead (median of paired runs): ours {ours['overhead']:+.1%}, llama-cpp-python {peer['overhead']:+.1%}; "
          f"our mask per token: mean {ours['mask_ms_mean']:.3f} ms, p99 {ours['mask_ms_p99']:.3f} ms")
    for clients in (1, 16):
        plain, held = server[f"server_{clients}_plain_tok_s"], server[f"server_{clients}_schema_tok_s"]
        print(f"server, {clients:2d} clients: {plain:7.1f} tok/s plain, {held:7.1f} with the schema ({1 - held / plain:+.1%})")
    OUT.mkdir(exist_ok=True)
    (OUT / "structured.json").write_text(json.dumps({"threads": args.threads, "schema": SCHEMA, "ours": ours,
                                                     "llama-cpp-python": peer, "server": server}, indent=2))


if __name__ == "__main__":
    main()

"""Embedding speed: ours vs sentence-transformers (torch), all-MiniLM-L6-v2, same machine, same run.

Sentences per second at batch 1 and batch 32 over a fixed set of 256 sentences (5 to 40 words),
best of 3 passes after a warm-up, 2 threads each, each engine in its own process; the engines
alternate over --rounds rounds and each reports its median. Ours runs as
loaded by default (bf16 matmuls on AMX CPUs) and with exact f32 activations; sentence-transformers
in its default f32 and cast to bf16 (torch's oneDNN, AMX too). Ratios are against the f32 default.
With --device cuda both engines run on the GPU (ours f16/bf16 or f32 as loaded, theirs f32 and bf16); --model
takes another directory of the same kind (a random-weight copy of the model where its weights are not at hand:
speed does not depend on them). Run: python bench/embed.py [--threads 2] [--rounds 3] [--device cpu|cuda]
[--model DIR]; JSON goes to bench/out/embed-<device>.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from workers import median_of, run_worker

OUT = Path(__file__).parent / "out"
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from",
         "his", "her", "an", "were", "are", "which", "this", "be", "or", "has", "had", "city", "river",
         "music", "market", "science", "history", "garden", "window", "morning", "engine", "language",
         "people", "water", "light"]
BATCHES = (1, 32)


def sentences(n: int = 256) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 41)))).capitalize() + "." for _ in range(n)]


def timed(encode, texts, batch) -> float:
    encode(texts[:batch * 2], batch)                     # warm-up: plans, caches, thread pools
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        encode(texts, batch)
        best = min(best, time.perf_counter() - start)
    return len(texts) / best


def worker_ours(threads: int, device: str, path: str, activations: str | None = None) -> dict:
    from soma_runtime.tasks import Runtime
    model = Runtime(device, threads=threads).load(path, progress=False, activations=activations)
    texts = sentences()
    return {"activations": model.info()["activations"],
            **{f"batch_{b}": timed(lambda t, b: model.embed(t, batch_size=b), texts, b) for b in BATCHES}}


def worker_st(threads: int, device: str, path: str, bf16: bool = False) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    from soma_runtime.loaders import resolve
    torch.set_num_threads(threads)
    model = SentenceTransformer(resolve(path), device=device)
    if bf16:
        model = model.to(torch.bfloat16)
    texts = sentences()
    with torch.inference_mode():
        return {f"batch_{b}": timed(lambda t, b: model.encode(t, batch_size=b), texts, b) for b in BATCHES}


WORKERS = {"ours": worker_ours, "ours f32": lambda *a: worker_ours(*a, "f32"),
           "sentence-transformers": worker_st, "sentence-transformers bf16": lambda *a: worker_st(*a, True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="engines alternate this many times; medians are reported")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="minilm", help="the model directory (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--worker", choices=list(WORKERS))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.threads, args.device, args.model)))
        return
    rounds = {name: [] for name in WORKERS}
    for _ in range(args.rounds):
        for name in WORKERS:
            rounds[name].append(run_worker(__file__, name, "--device", args.device, "--model", args.model,
                                           threads=args.threads, timeout=1800))
    results = {name: median_of(r) for name, r in rounds.items()}
    print(f"{args.model}, 256 sentences, {args.device}, threads={args.threads}, median of {args.rounds} alternating rounds")
    print(f"{'engine':28s} " + " ".join(f"{f'batch {b} sent/s':>16s}" for b in BATCHES) + "   vs sentence-transformers")
    peer = results["sentence-transformers"]
    for name, r in results.items():
        if "error" in r:
            print(f"{name:28s} error: {r['error'].strip().splitlines()[-1]}")
            continue
        ratios = " / ".join(f"{r[f'batch_{b}'] / peer[f'batch_{b}']:.2f}x" for b in BATCHES) if "error" not in peer else ""
        label = f"{name} ({r['activations']})" if "activations" in r else name
        print(f"{label:28s} " + " ".join(f"{r[f'batch_{b}']:16.1f}" for b in BATCHES) + f"   {ratios}")
    OUT.mkdir(exist_ok=True)
    path = OUT / f"embed-{args.device}.json"
    path.write_text(json.dumps({"device": args.device, "model": args.model, "threads": args.threads,
                                "rounds": args.rounds, "results": results}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

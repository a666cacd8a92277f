"""Compressed KV caches: quality, size and speed. Perplexity of SmolLM2 over a fixed text (Python's own
reference documentation, pydoc_data, the first `--tokens` tokens) with each cache kind, in one process,
and llama.cpp's own q8_0/q4_0 caches (type_k/type_v, flash attention; it rotates quantized caches) over
the same token ids as the peer; bytes per token for each. The f16 rows of both engines anchor the
comparison. q8 activations (the GGUF default, as llama.cpp) round each matmul's input, so a change far
below a codec's error moves the perplexity by up to about 1%; --exact adds a pass with f32 activations,
which ranks the kinds without that noise (each against its own f16). With --speed (a GPU): a random
Llama-3.2-1B-shape model's decode step at 4k, 16k and 64k tokens of context, f16 vs tq4 and tq3 caches,
the kinds alternating over rounds (median step time).
Run: python bench/kv_cache.py [--tokens 3072] [--threads 2] [--device cpu|cuda] [--kinds f16,q8_0,...]
[--exact] [--speed]; JSON goes to bench/out/kv-cache-<device>.json (kv-speed-<device>.json with --speed).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "out"
KINDS = ("f16", "q8_0", "q4_0", "tq4", "tq3", "tq2", "tq4/tq2", "tq3j", "tq2j")
LLAMA_KINDS = {"f16": 1, "q8_0": 8, "q4_0": 2}          # GGML type numbers


def text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each token after the first, given those before it."""
    logits = logits[:-1].astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_z = (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1)))
    return float(np.exp(np.mean(log_z - logits[np.arange(len(ids) - 1), ids[1:]])))


def ours(path: str, ids: list[int], kinds, device: str, threads: int, activations: str | None = None) -> dict:
    from soma_runtime.api import Runtime
    runtime = Runtime(device, threads=threads)
    results = {}
    for kind in kinds:
        model = runtime.load(path, kv_dtype=kind, n_ctx=len(ids) + 16, progress=False, activations=activations)
        start = time.perf_counter()
        ppl = perplexity(model.logits(ids), ids)
        results[kind] = {"perplexity": ppl, "bytes_per_token": model.engine.cache.token_bytes(),
                         "seconds": time.perf_counter() - start}
        print(f"soma  {kind:10s} ppl {ppl:8.4f}  {results[kind]['bytes_per_token']:6d} B/token  "
              f"({results[kind]['seconds']:.1f} s)", flush=True)
        runtime.unload(model.id)
    return results


def llama(path: str, ids: list[int], threads: int) -> dict:
    from llama_cpp import Llama
    results = {}
    for kind, ggml in LLAMA_KINDS.items():
        llm = Llama(path, n_ctx=len(ids) + 16, n_batch=512, n_threads=threads, type_k=ggml, type_v=ggml, flash_attn=True,
                    logits_all=True, verbose=False)
        llm.eval(ids)
        ppl = perplexity(np.asarray(llm.scores[:len(ids)]), ids)
        results[kind] = {"perplexity": ppl}
        print(f"llama {kind:10s} ppl {ppl:8.4f}", flush=True)
        del llm
    return results


SPEED_KINDS, CONTEXTS, STEPS = ("f16", "tq4", "tq3"), (4096, 16384, 65536), 64


def decode_step_seconds(model, context: int) -> float:
    """Median time of one greedy decode step of a sequence whose cache holds `context` tokens (their
    values do not matter: attention reads them all the same)."""
    import statistics

    from soma_runtime.engine.kv import Sequence
    from soma_runtime.engine.sampling import greedy_rows
    engine, seq = model.engine, Sequence()
    engine.pool.reserve(seq, context + 1)
    try:
        times = []
        for _ in range(STEPS):
            seq.length = context
            start = time.perf_counter()
            engine.forward([(seq, [1], 1)], greedy_rows(1))
            times.append(time.perf_counter() - start)
        return statistics.median(times[STEPS // 4:])
    finally:
        engine.pool.release(seq)


def speed(device: str, rounds: int) -> dict:
    import sys
    import tempfile
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llm_cuda import SHAPES

    from soma_runtime.api import Runtime
    from tests.fixtures.decoders import random_llama
    directory = tempfile.mkdtemp(prefix="kv-speed-")
    random_llama({**SHAPES["1b"], "max_position_embeddings": 2 * CONTEXTS[-1]}, directory, device=device)
    runtime = Runtime(device)
    models = {kind: runtime.load(directory, kv_dtype=kind, n_ctx=CONTEXTS[-1] + 16, progress=False) for kind in SPEED_KINDS}
    times = {(kind, n): [] for kind in SPEED_KINDS for n in CONTEXTS}
    for _ in range(rounds):
        for n in CONTEXTS:
            for kind, model in models.items():
                times[kind, n].append(decode_step_seconds(model, n))
    results = {}
    for n in CONTEXTS:
        base = float(np.median(times["f16", n]))
        for kind, model in models.items():
            t = float(np.median(times[kind, n]))
            cache_gb = model.engine.cache.token_bytes() * n / 1e9
            results[f"{kind}@{n}"] = {"step_ms": t * 1e3, "tok_s": 1 / t, "vs_f16": base / t, "cache_gb": cache_gb}
            print(f"{kind:5s} context {n:6d}: {t * 1e3:7.3f} ms/token  {1 / t:7.1f} tok/s  {base / t:5.2f}x f16  "
                  f"cache read {cache_gb:.2f} GB", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--exact", action="store_true", help="also our kinds with f32 activations")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.speed:
        results = speed(args.device, args.rounds)
        OUT.mkdir(exist_ok=True)
        (OUT / f"kv-speed-{args.device}.json").write_text(json.dumps({"device": args.device, "results": results}, indent=2))
        return
    from soma_runtime.loaders import resolve
    path = resolve("default")
    from soma_runtime.api import Runtime
    ids = Runtime("cpu").load(path, progress=False).tokenize(text())[:args.tokens]
    results = {"soma": ours(path, ids, args.kinds.split(","), args.device, args.threads)}
    if not args.no_llama:
        results["llama.cpp"] = llama(path, ids, args.threads)
    if args.exact:
        results["soma f32 activations"] = ours(path, ids, args.kinds.split(","), args.device, args.threads, "f32")
    if "f16" in results["soma"]:
        for engine, rs in results.items():
            base = results["soma f32 activations" if engine == "soma f32 activations" else "soma"]["f16"]["perplexity"]
            for r in rs.values():
                r["vs_soma_f16"] = r["perplexity"] / base - 1
        print("vs our f16: " + ", ".join(f"{e}/{k} {r['vs_soma_f16']:+.2%}" for e, rs in results.items() for k, r in rs.items()))
    OUT.mkdir(exist_ok=True)
    path = OUT / f"kv-cache-{args.device}.json"
    path.write_text(json.dumps({"tokens": len(ids), "device": args.device, "threads": args.threads, "results": results},
                               indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

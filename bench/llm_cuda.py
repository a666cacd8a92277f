"""LLM speed on an NVIDIA GPU: ours (the cuda backend) vs HF transformers, same GPU, same run.

Random-weight Llama-3.2-1B-shape models (bf16, and q4_0 converted from it), a 512-token prompt,
128 greedy tokens, median of 3 after a warm-up; the same sampled (llama.cpp's default sampler, on the
device), and batch-32 decode through the server's scheduler, greedy then sampled (median of 3 batches
of 32 requests); the bf16 model
again with an f32 KV cache (ours, as HF, keeps a bf16 model's cache in bf16 by default); and a
Q4_K_M-mixed GGUF of random K-quant blocks (greedy only; tests/fixtures/kquant.py). Peers: HF eager, and HF
with a static cache and torch.compile (batch 1). Decode rates exclude the prompt for every engine.
Decode GB/s counts the weight bytes one token reads, against the measured device-to-device copy
bandwidth.
Run (on a GPU machine): python bench/llm_cuda.py [--out DIR] [--shape 1b|8b]; JSON in bench/out/llm_cuda.json.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository: bench/ and tests/fixtures

import numpy as np
import torch

from tests.fixtures.decoders import random_llama

OUT = Path(__file__).parent / "out"
PROMPT_TOKENS, NEW_TOKENS, RUNS, BATCH = 512, 128, 3, 32
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 0}     # llama.cpp's defaults
SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False},
}


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read plus written per second (the ceiling decode is held to)."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - start)


def prompt(vocab: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(0).integers(100, min(vocab, 300), (rows, PROMPT_TOKENS))


def bench_ours(path: str, kv_dtype: str | None = None, greedy_only: bool = False) -> dict:
    from soma_runtime.cli.bench import bench_model
    from soma_runtime.tasks import Runtime
    model = Runtime("cuda").load(path, n_ctx=1024, progress=False, kv_dtype=kv_dtype)
    result = bench_model(model, PROMPT_TOKENS, NEW_TOKENS, RUNS)
    if greedy_only:
        return result
    result["sampled_decode_tok_s"] = bench_model(model, PROMPT_TOKENS, NEW_TOKENS, RUNS, **SAMPLED)["decode_tok_s"]
    torch.cuda.reset_peak_memory_stats()
    result["batch32_decode_tok_s"] = batch_rate(model)
    result["batch32_sampled_tok_s"] = batch_rate(model, **SAMPLED)
    result["batch32_peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30       # weights, KV pool and a step's activations
    return result


def batch_rate(model, **sampling) -> float:
    """Tok/s of BATCH requests decoding together through the server's scheduler (continuous batching,
    each step launched before the tokens of the one before it are read): the tokens after every
    request's first, over the time they took. Greedy, or `sampling` seeded per request. Median of
    RUNS batches, after one that captures the step's graph."""
    scheduler = model.serve(max_batch=BATCH, step_tokens=BATCH * PROMPT_TOKENS)         # the prompts in one step
    rates, arrivals = [], queue.Queue()
    try:
        for _ in range(RUNS + 1):
            for i, row in enumerate(prompt(1000, BATCH)):
                params = {**sampling, "seed": i} if sampling else {"temperature": 0}
                scheduler.submit(model.request([int(t) for t in row], NEW_TOKENS, ignore_eos=True, **params),
                                 lambda item, i=i: arrivals.put((time.perf_counter(), i, item)))
            firsts, after, done = set(), 0, 0
            while done < BATCH:
                at, i, item = arrivals.get(timeout=600)
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    done += 1
                elif len(firsts) < BATCH:
                    firsts.add(i)
                    start = at
                else:
                    after, end = after + 1, at
            rates.append(after / (end - start))
    finally:
        scheduler.close()
    return statistics.median(rates[1:])


def seconds(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_hf(model, vocab: int, batched: bool = True) -> dict:
    """HF generate: prefill = prompt tokens / time to the first token; decode = the tokens after the
    first / the time they add (the prompt excluded, as ours is), for one sequence and for 32."""
    generate = lambda ids, new: seconds(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False))
    ids, batch = (torch.tensor(prompt(vocab, rows), device="cuda") for rows in (1, BATCH))
    prefill, decode = [], []
    with torch.no_grad():
        for _ in range(RUNS + 1):                          # the first pass warms up (and compiles)
            first = generate(ids, 1)
            prefill.append(PROMPT_TOKENS / first)
            decode.append((NEW_TOKENS - 1) / max(generate(ids, NEW_TOKENS) - first, 1e-9))
        result = {"prefill_tok_s": statistics.median(prefill[1:]), "decode_tok_s": statistics.median(decode[1:])}
        if batched:
            first = generate(batch, 1)
            result["batch32_decode_tok_s"] = BATCH * 31 / max(generate(batch, 32) - first, 1e-9)
    return result


def compiled(model):
    """HF's fast path: a static KV cache, under which `generate` compiles the forward itself
    (torch.compile, "reduce-overhead": CUDA graphs). Compiling `model.forward` by hand on top of that
    failed on the H200 (a CUDA-graph output overwritten by the next replay)."""
    model.generation_config.cache_implementation = "static"
    return model


def report(rows: dict, results: dict, out: str) -> None:
    """Print the table and write the JSON (after every engine, so a cut-short run keeps what it has)."""
    print(f"\n{'model / engine':30s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'GB/s':>8s} {'of bw':>6s} "
          f"{'sampled tok/s':>14s}"
          f" {'batch32 tok/s':>14s} {'sampled':>8s} {'peak GiB':>8s}")
    for name, r in rows.items():
        gbs = f"{r['GB/s']:8.0f} {r['bandwidth_share'] * 100:5.0f}%" if "GB/s" in r else f"{'':8s} {'':6s}"
        sampled = f"{r['sampled_decode_tok_s']:14.1f}" if "sampled_decode_tok_s" in r else f"{'':14s}"
        batch = f"{r['batch32_decode_tok_s']:14.0f}" if "batch32_decode_tok_s" in r else ""
        batch += f" {r['batch32_sampled_tok_s']:8.0f}" if "batch32_sampled_tok_s" in r else ""
        batch += f" {r['batch32_peak_GiB']:7.1f}" if "batch32_peak_GiB" in r else ""
        print(f"{name:30s} {r['prefill_tok_s']:14.0f} {r['decode_tok_s']:13.1f} {gbs} {sampled} {batch}", flush=True)
    results["models"] = rows
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "llm_cuda.json").write_text(json.dumps(results, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    results = {"device": torch.cuda.get_device_name(), "copy_TB_s": bandwidth / 1e12, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, f"llama-{args.shape}-bf16")
        hf_model = random_llama(SHAPES[args.shape], hf_dir, "cuda").eval()
        from soma_runtime.convert import convert_hf_to_gguf
        from tests.fixtures.kquant import k_quant_gguf
        q4 = convert_hf_to_gguf(hf_dir, os.path.join(tmp, f"llama-{args.shape}.q4_0.gguf"), "q4_0")
        rows = {}
        k_mix = k_quant_gguf(q4, os.path.join(tmp, f"llama-{args.shape}.q4_K_M.gguf"), encode=False)
        for name, path, kv_dtype in ((f"{args.shape} bf16 / ours", hf_dir, None), (f"{args.shape} q4_0 / ours", q4, None),
                                     (f"{args.shape} bf16, f32 KV / ours", hf_dir, "f32"),
                                     (f"{args.shape} q4_K_M / ours", k_mix, None)):
            rows[name] = r = bench_ours(path, kv_dtype, greedy_only=kv_dtype is not None or path == k_mix)
            r["bandwidth_share"] = r["GB/s"] * 1e9 / bandwidth
            report(rows, results, args.out)
            torch.cuda.empty_cache()
        torch.cuda.empty_cache()
        if not args.skip_hf:
            vocab = SHAPES[args.shape]["vocab_size"]
            rows[f"{args.shape} bf16 / HF eager"] = bench_hf(hf_model, vocab)
            report(rows, results, args.out)
            try:
                rows[f"{args.shape} bf16 / HF static+compile"] = bench_hf(compiled(hf_model), vocab, batched=False)
            except RuntimeError as e:               # a peer that fails is reported, not fatal
                results["hf_compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                print(f"HF static+compile failed: {results['hf_compile_error']}")
            report(rows, results, args.out)

if __name__ == "__main__":
    main()

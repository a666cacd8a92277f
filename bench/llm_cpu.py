"""LLM speed on CPU: ours vs llama.cpp (llama-cpp-python) vs HF transformers, same machine, same run.

Models: the bundled SmolLM2-135M Q4_1 GGUF, Llama-3.2-1B-shape GGUFs (q4_0, q8_0, f16) and an
OLMoE-1B-7B-shape q4_0 GGUF (64 experts, 8 used) with random weights (written here; HF transformers
runs the SmolLM2 and f16 ones). Each engine runs in its own process (so peak RSS
is its own): a 128-token prompt,
then 128 greedy tokens, median of 3 runs after a warm-up. Decode GB/s counts the weight bytes one
token reads (of experts, the used share), against this machine's measured matrix-vector read bandwidth.
Run: python bench/llm_cpu.py [--threads 2] [--skip-1b] [--skip-moe] [--skip-hf]; JSON goes to bench/out/llm_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository: bench/ and tests/fixtures

import numpy as np

from soma_runtime.memory import peak_rss_mb  # the worker's own peak (VmHWM), not its parent's

OUT = Path(__file__).parent / "out"
PROMPT_TOKENS, NEW_TOKENS, RUNS = 128, 128, 3


def prompt_ids(vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(100, min(vocab, 30000), PROMPT_TOKENS)]


def worker_ours(path, threads):
    from soma_runtime.tasks import Runtime
    model = Runtime(threads=threads).load(path, progress=False)
    from soma_runtime.cli.bench import bench_model
    r = bench_model(model, PROMPT_TOKENS, NEW_TOKENS, RUNS)
    return {"prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"]}


def worker_llama(path, threads):
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    ids = prompt_ids(llm.n_vocab())
    prefill, decode = [], []
    for _ in range(RUNS + 1):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        prefill.append(PROMPT_TOKENS / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(NEW_TOKENS):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([token])
        decode.append(NEW_TOKENS / (time.perf_counter() - t))
    return {"prefill_tok_s": statistics.median(prefill[1:]), "decode_tok_s": statistics.median(decode[1:])}


def worker_hf(path, threads):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids(model.config.vocab_size)])
    prefill, decode = [], []
    with torch.no_grad():
        for _ in range(RUNS + 1):
            t = time.perf_counter()
            out = model(ids, use_cache=True)
            prefill.append(PROMPT_TOKENS / (time.perf_counter() - t))
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(NEW_TOKENS):
                out = model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            decode.append(NEW_TOKENS / (time.perf_counter() - t))
    return {"prefill_tok_s": statistics.median(prefill[1:]), "decode_tok_s": statistics.median(decode[1:])}


WORKERS = {"ours": worker_ours, "llama.cpp": worker_llama, "hf-f32": worker_hf}


def run_worker(engine, path, threads):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, __file__, "--worker", engine, "--model", path, "--threads", str(threads)],
                       capture_output=True, text=True, env=env, timeout=3600, check=False)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def decode_bytes(path) -> int:
    """Weight bytes one decoded token reads: everything but the embedding table (unless it is the head),
    of merged experts only the share a token routes to."""
    from soma_runtime.loaders.gguf import read_gguf
    f = read_gguf(path)
    tensors, arch = f.tensors, f.metadata["general.architecture"]
    used = f.metadata.get(f"{arch}.expert_used_count", 1) / f.metadata.get(f"{arch}.expert_count", 1)
    total = int(sum(t.nbytes * (used if "_exps." in name else 1) for name, t in tensors.items()))
    return total if "output.weight" not in tensors else total - int(tensors["token_embd.weight"].nbytes)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", choices=list(WORKERS))
    ap.add_argument("--model")
    ap.add_argument("--skip-1b", action="store_true")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    if args.worker:
        result = WORKERS[args.worker](args.model, args.threads)
        result["peak_rss_mb"] = peak_rss_mb()
        print(json.dumps(result))
        return

    import torch
    sys.path.insert(0, str(Path(__file__).parent))
    from ops import bandwidth_gbs

    from soma_runtime.loaders import default_model_path
    torch.set_num_threads(args.threads)
    bw = bandwidth_gbs(torch)
    OUT.mkdir(exist_ok=True)
    models = {"SmolLM2-135M Q4_1": default_model_path()}
    if not args.skip_1b:
        from tests.fixtures.decoders import random_llama_gguf  # here: the workers' memory is their engine's alone
        for kind in ("q4_0", "q8_0", "f16"):
            models[f"Llama-3.2-1B shape {kind}"] = random_llama_gguf(str(OUT / f"llama-1b-shape.{kind}.gguf"), kind)
    if not args.skip_moe:
        from tests.fixtures.decoders import random_olmoe_gguf
        models["OLMoE-1B-7B shape q4_0"] = random_olmoe_gguf(str(OUT / "olmoe-1b-7b-shape.q4_0.gguf"), "q4_0")
    print(f"threads={args.threads}  prompt={PROMPT_TOKENS}  new={NEW_TOKENS}  bandwidth={bw:.1f} GB/s")
    print(f"{'model':26s} {'engine':10s} {'prefill t/s':>11s} {'decode t/s':>10s} {'decode GB/s':>11s} {'of bw':>6s} "
          f"{'RSS MB':>7s} {'decode vs llama.cpp':>20s}")
    report = {"threads": args.threads, "bandwidth_GBps": bw, "models": {}}
    for label, path in models.items():
        nbytes = decode_bytes(path)
        engines = ["ours", "llama.cpp"] + ([] if args.skip_hf or label.endswith(("q4_0", "q8_0")) else ["hf-f32"])
        results = {e: run_worker(e, path, args.threads) for e in engines}
        report["models"][label] = {"path": path, "decode_weight_bytes": nbytes, "limit_tok_s": bw * 1e9 / nbytes, **results}
        peer = results["llama.cpp"].get("decode_tok_s")
        for e, r in results.items():
            if "error" in r:
                print(f"{label:26s} {e:10s} error: {r['error']}")
                continue
            gbs = r["decode_tok_s"] * nbytes / 1e9
            prefill_peer = results["llama.cpp"].get("prefill_tok_s")
            ratio = f"{r['decode_tok_s'] / peer:.2f}x / prefill {r['prefill_tok_s'] / prefill_peer:.2f}x" if peer else ""
            print(f"{label:26s} {e:10s} {r['prefill_tok_s']:11.1f} {r['decode_tok_s']:10.1f} {gbs:11.2f} {gbs / bw:6.0%} "
                  f"{r['peak_rss_mb']:7.0f} {ratio:>20s}")
        print(f"{label:26s} {'limit':10s} {'':11s} {bw * 1e9 / nbytes:10.1f}")
    (OUT / "llm_cpu.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {OUT / 'llm_cpu.json'}")


if __name__ == "__main__":
    main()

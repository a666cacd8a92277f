"""LLM speed on CPU: ours vs llama.cpp (llama-cpp-python) vs HF transformers, same machine, same run.

Models: the bundled SmolLM2-135M Q4_1 GGUF, and Llama-3.2-1B-shape GGUFs (q4_0, q8_0, f16) with
random weights (written here; HF transformers runs the SmolLM2 and f16 ones). Each engine runs in its own process (so peak RSS is its own): a 128-token prompt,
then 128 greedy tokens, median of 3 runs after a warm-up. Decode GB/s counts the weight bytes one
token reads, against this machine's measured matrix-vector read bandwidth.
Run: python bench/llm_cpu.py [--threads 2] [--skip-1b] [--skip-hf]; JSON goes to bench/out/llm_cpu.json.
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

import numpy as np

OUT = Path(__file__).parent / "out"
PROMPT_TOKENS, NEW_TOKENS, RUNS = 128, 128, 3


def peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM): ru_maxrss would include the parent it was forked from."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def prompt_ids(vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(100, min(vocab, 30000), PROMPT_TOKENS)]


def worker_ours(path, threads):
    from soma_runtime.api import Runtime
    model = Runtime(threads=threads).load(path, progress=False)
    from soma_runtime.bench_llm import bench_model
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
    """Weight bytes one decoded token reads: everything but the embedding table (unless it is the head)."""
    from soma_runtime.loaders.gguf import read_gguf
    tensors = read_gguf(path).tensors
    total = sum(int(t.nbytes) for t in tensors.values())
    return total if "output.weight" not in tensors else total - int(tensors["token_embd.weight"].nbytes)


def write_1b(path: str, kind: str) -> str:
    """A Llama-3.2-1B-shape GGUF with random weights (finite scales) and a 128k vocabulary; `kind` is
    q4_0, q8_0 (random blocks) or f16 (normal * 0.02)."""
    import gguf

    from soma_runtime.loaders import default_model_path
    from soma_runtime.loaders.gguf import read_gguf
    if os.path.exists(path):
        return path
    meta = read_gguf(default_model_path()).metadata
    vocab, hidden, ffn, layers, heads, kv, hd = 128256, 2048, 8192, 16, 32, 8, 64
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    for key, value in [("context_length", 8192), ("embedding_length", hidden), ("block_count", layers),
                       ("feed_forward_length", ffn), ("attention.head_count", heads), ("attention.head_count_kv", kv)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.rope.dimension_count", hd)
    tokens = list(meta["tokenizer.ggml.tokens"]) + [f"<unused_{i}>" for i in range(vocab - len(meta["tokenizer.ggml.tokens"]))]
    types = list(meta["tokenizer.ggml.token_type"]) + [5] * (vocab - len(meta["tokenizer.ggml.token_type"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    block = {"q4_0": 18, "q8_0": 34}

    def add_matrix(name, rows, cols):
        if kind == "f16":
            w.add_tensor(name, (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(np.float16))
            return
        blocks = rng.integers(0, 256, size=(rows * cols // 32, block[kind]), dtype=np.uint8)
        blocks[:, :2] = (rng.standard_normal((len(blocks), 1)) * (0.004 if kind == "q4_0" else 0.0005)).astype(np.float16).view(np.uint8)
        w.add_tensor(name, blocks.reshape(rows, -1), raw_shape=blocks.reshape(rows, -1).shape,
                     raw_dtype=gguf.GGMLQuantizationType[kind.upper()])

    add_matrix("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"{p}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in [("attn_q", heads * hd, hidden), ("attn_k", kv * hd, hidden), ("attn_v", kv * hd, hidden),
                                 ("attn_output", hidden, heads * hd), ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden),
                                 ("ffn_down", hidden, ffn)]:
            add_matrix(f"{p}.{name}.weight", rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", choices=list(WORKERS))
    ap.add_argument("--model")
    ap.add_argument("--skip-1b", action="store_true")
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
        for kind in ("q4_0", "q8_0", "f16"):
            models[f"Llama-3.2-1B shape {kind}"] = write_1b(str(OUT / f"llama-1b-shape.{kind}.gguf"), kind)
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
            ratio = f"{r['decode_tok_s'] / peer:.2f}x / prefill {r['prefill_tok_s'] / results['llama.cpp']['prefill_tok_s']:.2f}x" if peer else ""
            print(f"{label:26s} {e:10s} {r['prefill_tok_s']:11.1f} {r['decode_tok_s']:10.1f} {gbs:11.2f} {gbs / bw:6.0%} "
                  f"{r['peak_rss_mb']:7.0f} {ratio:>20s}")
        print(f"{label:26s} {'limit':10s} {'':11s} {bw * 1e9 / nbytes:10.1f}")
    (OUT / "llm_cpu.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {OUT / 'llm_cpu.json'}")


if __name__ == "__main__":
    main()

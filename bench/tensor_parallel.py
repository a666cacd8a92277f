"""Tensor parallel: one model at 1, 2, 4, ... ranks in one run (GPUs with NCCL, or host processes with
gloo): the greedy tokens of each against one rank's, prefill and batch-1 decode tok/s, batch-32 decode
through the server's scheduler, and the scaling efficiency (speed-up over one rank, per rank). On GPUs
the random 8B bf16 Llama of llm_cuda.py (target: 2 ranks >= 1.6x one rank's batch-1 decode); elsewhere
its tiny shape, which checks the path rather than the speed.
Run: python bench/tensor_parallel.py [--backend cuda|cpu] [--shape 8b|1b|tiny] [--ranks 1,2,4]; JSON in
bench/out/tensor-parallel-<backend>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository: bench/ and tests/fixtures
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llm_cuda import SHAPES, batch_rate

from tests.fixtures.decoders import random_llama

OUT = Path(__file__).parent / "out"
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 512, "tie_word_embeddings": False}
PROMPT, NEW = 512, 128


def run(path: str, backend: str, ranks: int, batched: bool) -> tuple[dict, list[int]]:
    from soma_runtime.cli.bench import bench_model
    from soma_runtime.tasks import Runtime
    runtime = Runtime(backend)
    model = runtime.load(path, n_ctx=1024, progress=False, tensor_parallel=ranks)
    try:
        result = bench_model(model, PROMPT, NEW, 3)
        tokens = [t.id for t in model.generate(list(range(100, 164)), max_tokens=32, temperature=0)]
        if batched:
            result["batch32_decode_tok_s"] = batch_rate(model)
    finally:
        runtime.unload(model.id)
    return result, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default=None, choices=("8b", "1b", "tiny"))
    ap.add_argument("--ranks", default=None, help="comma-separated (default: 1 and each doubling up to the GPUs)")
    args = ap.parse_args()
    shape = args.shape or ("8b" if args.backend == "cuda" else "tiny")
    if args.ranks:
        counts = [int(n) for n in args.ranks.split(",")]
    else:
        import torch
        top = torch.cuda.device_count() if args.backend == "cuda" else 2
        counts = [n for n in (1, 2, 4, 8) if n <= top]
    directory = tempfile.mkdtemp(prefix="tp-bench-")
    random_llama(SHAPES.get(shape, TINY), directory, device=args.backend)
    rows, base_tokens = {}, None
    for n in counts:
        result, tokens = run(directory, args.backend, n, args.backend == "cuda")
        base_tokens = tokens if base_tokens is None else base_tokens
        one = rows.get(1, result)
        result.update(same_tokens=tokens == base_tokens, speedup=result["decode_tok_s"] / one["decode_tok_s"])
        result["efficiency"] = result["speedup"] / n
        rows[n] = result
        print(f"TP={n}: prefill {result['prefill_tok_s']:9.1f} tok/s  decode {result['decode_tok_s']:8.1f} tok/s  "
              f"{result['speedup']:.2f}x one rank ({100 * result['efficiency']:.0f}% efficient)"
              + (f"  batch-32 {result['batch32_decode_tok_s']:8.1f} tok/s" if "batch32_decode_tok_s" in result else "")
              + f"  same tokens: {result['same_tokens']}", flush=True)
    OUT.mkdir(exist_ok=True)
    out = OUT / f"tensor-parallel-{args.backend}.json"
    out.write_text(json.dumps({"shape": shape, "backend": args.backend, "nccl_nvls": os.environ.get("NCCL_NVLS_ENABLE"),
                               "ranks": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

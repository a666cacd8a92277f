"""Device splitting on a GPU machine: a random-weight Llama-3.2-1B-shape model (bf16) with all of its
layers on the GPU, some of them, and none (all on the CPU), loaded side by side and run in alternating
rounds: prefill and greedy decode tok/s for each, and each split's decode against the whole model's on
the GPU. The limit a split decode meets is the host's: the offloaded layers' weights stream from host
memory through the CPU's cores. Run: python bench/split.py [--threads 16] [--rounds 3] [--tokens 64];
JSON in bench/out/split.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository: bench/ and tests/fixtures

from llm_cuda import SHAPES

from soma_runtime.cli.bench import bench_model
from tests.fixtures.decoders import random_llama

OUT = Path(__file__).parent / "out"
PROMPT_TOKENS = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from soma_runtime.tasks import Runtime
    directory = tempfile.mkdtemp(prefix="split-1b-")
    random_llama(SHAPES["1b"], directory, device="cuda")
    layers = SHAPES["1b"]["num_hidden_layers"]
    splits = [layers, 3 * layers // 4, layers // 2, layers // 4, 0]
    runtime = Runtime("cuda", threads=args.threads)
    models = {k: runtime.load(directory, gpu_layers=k, progress=False) for k in splits}
    runs = {k: [] for k in splits}
    for _ in range(args.rounds):
        for k, model in models.items():
            runs[k].append(bench_model(model, PROMPT_TOKENS, args.tokens, 1))
    whole = statistics.median(r["decode_tok_s"] for r in runs[layers])
    results = {}
    print(f"random 1B bf16, {PROMPT_TOKENS}-token prompt, {args.tokens} tokens greedy, median of {args.rounds} rounds")
    for k in splits:
        prefill = statistics.median(r["prefill_tok_s"] for r in runs[k])
        decode = statistics.median(r["decode_tok_s"] for r in runs[k])
        results[str(k)] = {"gpu_layers": k, "prefill_tok_s": prefill, "decode_tok_s": decode, "vs_all_on_gpu": decode / whole}
        print(f"gpu_layers {k:2d}/{layers}: prefill {prefill:8.1f} tok/s  decode {decode:7.1f} tok/s  "
              f"{decode / whole:5.2f}x all on GPU")
    OUT.mkdir(exist_ok=True)
    path = OUT / "split.json"
    path.write_text(json.dumps({"model": "random llama-3.2-1b shape, bf16", "threads": args.threads, "rounds": args.rounds,
                                "tokens": args.tokens, "results": results}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""LoRA at run time on SmolLM2: the throughput of 16 streams decoding together, each under one of 8 random
rank-16 adapters on every linear layer (2 streams an adapter; `--base-rows N` of the 16 under none), against
the same 16 streams on the model with no adapter loaded (its graph has no adapter ops), same process, the two
alternating over rounds (median); and what loading an adapter takes (the first also rebuilds the graphs).
Greedy, ignore_eos, so every round writes the same number of tokens.
Run: python bench/lora.py [--threads 2] [--rounds 3] [--tokens 64] [--streams 16] [--rank 16] [--adapters 8];
JSON goes to bench/out/cpu-lora.json.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "out"
TARGETS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
PROMPTS = ["Write a short story about a dragon who learns to paint.", "Explain how a bicycle stays upright.",
           "List five uses for a paper clip.", "Describe the water cycle to a child."]


def write_adapter(directory: Path, model, rank: int, seed: int) -> None:
    """A PEFT LoRA directory for `model`'s base with random factors on every linear layer."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(model.engine.cfg.num_layers):
        for kind, hf in TARGETS.items():
            out, inp = model.engine.weights[f"blk.{i}.{kind}.weight"].shape
            prefix = f"base_model.model.model.layers.{i}.{hf}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, inp)) / np.sqrt(inp)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.01).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                               "target_modules": [h.split(".")[-1] for h in TARGETS.values()]}))


def throughput(model, adapters: list[str | None], tokens: int) -> float:
    """Tokens a second of len(adapters) streams generated together, stream i under adapters[i]."""
    streams = [model.generate(PROMPTS[i % len(PROMPTS)], max_tokens=tokens, temperature=0, ignore_eos=True, lora=name)
               for i, name in enumerate(adapters)]
    start, count = time.perf_counter(), 0
    for _ in range(tokens):                      # consumed side by side: the scheduler batches them
        for s in streams:
            next(s)
            count += 1
    return count / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--base-rows", type=int, default=0)
    args = ap.parse_args()
    from soma_runtime.tasks import Runtime
    runtime = Runtime("cpu", threads=args.threads)
    base = runtime.load("default", progress=False)
    adapted = runtime.load("default", progress=False)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    loads = []
    for a in range(args.adapters):
        write_adapter(root / f"a{a}", adapted, args.rank, a)
        start = time.perf_counter()
        adapted.load_lora(str(root / f"a{a}"), max_loras=args.adapters)
        loads.append((time.perf_counter() - start) * 1e3)
    names = [f"a{i % args.adapters}" for i in range(args.streams - args.base_rows)] + [None] * args.base_rows
    throughput(base, [None] * args.streams, 8)              # warm-up: every plan a step of 1..streams rows takes
    throughput(adapted, names, 8)
    runs = {"base": [], "lora": []}
    for _ in range(args.rounds):
        runs["base"].append(throughput(base, [None] * args.streams, args.tokens))
        runs["lora"].append(throughput(adapted, names, args.tokens))
    tok_s = {k: float(np.median(v)) for k, v in runs.items()}
    ratio = tok_s["lora"] / tok_s["base"]
    print(f"LoRA at run time: SmolLM2-135M on cpu (threads={args.threads}), {args.streams} streams, {args.adapters} "
          f"rank-{args.rank} adapters on every linear layer, {args.base_rows} base streams, {args.tokens} tokens each, "
          f"median of {args.rounds} alternating rounds")
    print(f"base alone      {tok_s['base']:7.1f} tok/s")
    print(f"mixed adapters  {tok_s['lora']:7.1f} tok/s  {ratio:.2f}x base")
    print(f"adapter load    first {loads[0]:.0f} ms (graphs rebuilt), then median {np.median(loads[1:]):.1f} ms, "
          f"max {max(loads[1:]):.1f} ms")
    OUT.mkdir(exist_ok=True)
    path = OUT / "cpu-lora.json"
    path.write_text(json.dumps({"device": "cpu", "threads": args.threads, "model": "SmolLM2-135M-Instruct",
                                "streams": args.streams, "adapters": args.adapters, "rank": args.rank,
                                "base_rows": args.base_rows, "tokens": args.tokens, "rounds": args.rounds,
                                "tok_s": tok_s, "runs": runs, "ratio": ratio, "load_ms": loads}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

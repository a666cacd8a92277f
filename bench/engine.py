"""Speculative decoding on SmolLM2: decode tok/s with each draft kind vs plain decoding, same process, the
kinds alternating over rounds (median), greedy, so every kind writes the same tokens. Two prompts: a
summary of a given text (input-grounded: prompt lookup finds what comes next in it) and free writing
(little to look up: the adaptive draft length must back off). Reports acceptance rate, tokens per target
step and the speed-up over plain. `--model random-1b`: a random-weight Llama-3.2-1B-shape target (built on
the device; it repeats itself, so its acceptance shows what drafting costs and gives, not what a trained
model accepts). Run: python bench/engine.py [--threads 2] [--rounds 3] [--device cpu|cuda]
[--model PATH|random-1b] [--tokens 128]; JSON goes to bench/out/engine-DEVICE.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "out"
ARTICLE = (
    "The city council met on Tuesday evening to discuss the new public library. The new public library will be "
    "built on Main Street, next to the old post office. Construction of the new public library will start in "
    "March and finish in December. The council approved a budget of twelve million dollars for the new public "
    "library. The new public library will have a children's room, a computer lab, and a large reading hall. "
    "Mayor Ellen Park said that the new public library will serve more than forty thousand residents. Several "
    "residents asked the council to keep the old post office building. The council agreed to keep the old post "
    "office building and turn it into a community center.")
PROMPTS = {
    "grounded": [{"role": "user", "content": f"{ARTICLE}\n\nRepeat the key facts of the text above, sentence by "
                                              "sentence, in the same words."}],
    "free": [{"role": "user", "content": "Write a short story about a dragon who learns to paint."}],
}
DRAFTS = ("plain", "prompt-lookup", "layers:8")


def measure(model, messages, draft, tokens: int) -> dict:
    model.speculate(draft)
    try:
        ids = [t.id for t in model.chat(messages, max_tokens=tokens, temperature=0)]
    finally:
        model.speculate(None)
    m = model.metrics()
    return {"tok_s": m["decode_tok_s"], "tokens": len(ids), "acceptance_rate": m["acceptance_rate"],
            "tokens_per_step": m["tokens_per_step"], "ids": ids}


def random_1b(device: str) -> str:
    import sys
    import tempfile
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llm_cuda import SHAPES

    from tests.fixtures.decoders import random_llama
    directory = tempfile.mkdtemp(prefix="engine-1b-")
    random_llama(SHAPES["1b"], directory, device=device)
    return directory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    from soma_runtime.tasks import Runtime
    model = Runtime(args.device, threads=args.threads).load(random_1b(args.device) if args.model == "random-1b" else args.model,
                                                            progress=False)
    drafters = {d: model.drafter_of(None if d == "plain" else d) for d in DRAFTS}
    for messages in PROMPTS.values():                 # warm-up: plans compiled for every row count drafts use
        for drafter in drafters.values():
            measure(model, messages, drafter, 16)
    runs = {(p, d): [] for p in PROMPTS for d in DRAFTS}
    for _ in range(args.rounds):
        for p, messages in PROMPTS.items():
            for d, drafter in drafters.items():
                runs[p, d].append(measure(model, messages, drafter, args.tokens))
    results = {}
    print(f"speculative decoding, {args.model} on {args.device} (threads={args.threads}), greedy, {args.tokens} tokens, "
          f"median of {args.rounds} alternating rounds")
    for p in PROMPTS:
        plain = float(np.median([r["tok_s"] for r in runs[p, "plain"]]))
        for d in DRAFTS:
            rs = runs[p, d]
            same = all(r["ids"] == runs[p, "plain"][0]["ids"] for r in rs)
            figures = {k: float(np.median([r[k] for r in rs])) for k in ("tok_s", "acceptance_rate", "tokens_per_step")}
            results[f"{p}/{d}"] = {**figures, "vs_plain": figures["tok_s"] / plain, "tokens": rs[0]["tokens"],
                                   "same_tokens_as_plain": same}
            print(f"{p:9s} {d:14s} {figures['tok_s']:7.1f} tok/s  {figures['tok_s'] / plain:5.2f}x plain  "
                  f"acceptance {figures['acceptance_rate']:.2f}  tokens/step {figures['tokens_per_step']:.2f}  "
                  f"same tokens: {same}")
    OUT.mkdir(exist_ok=True)
    path = OUT / f"engine-{args.device}.json"
    path.write_text(json.dumps({"device": args.device, "threads": args.threads, "model": args.model,
                                "tokens": args.tokens, "rounds": args.rounds, "results": results}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

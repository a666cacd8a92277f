"""Prefill and decode speed of a loaded model, with the weight-read bandwidth decode achieves."""
from __future__ import annotations

import statistics

import numpy as np

from soma_runtime.errors import RequestError
from soma_runtime.tasks import check_count


def bench_model(model, prompt_tokens: int = 128, new_tokens: int = 128, runs: int = 3, **sampling) -> dict:
    """Median over `runs` of generation from a fixed pseudo-random prompt, EOS ignored: greedy, or
    with the given sampling params."""
    if model.task != "generate":
        raise RequestError(f"bench measures text generation; {model.id} runs the {model.task} task")
    for name, value in (("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens), ("runs", runs)):
        check_count(name, value)
    rng = np.random.default_rng(0)
    vocab = model.info()["vocab_size"]
    prompt = [int(t) for t in rng.integers(100, min(vocab, 30000), prompt_tokens)]
    results = []
    for _ in range(runs + 1):                                  # the first run warms the plans up
        for _ in model.generate(prompt, max_tokens=new_tokens, ignore_eos=True, **(sampling or {"temperature": 0})):
            pass
        results.append(model.metrics())
    results = results[1:]
    weight_bytes = model.info()["weight_bytes"]
    decode = statistics.median(r["decode_tok_s"] for r in results)
    return {"model": model.path, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in results), "decode_tok_s": decode,
            "GB/s": decode * weight_bytes / 1e9, "weight_bytes": weight_bytes,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results)}

"""Where a decode step's GPU time goes: the kernels of graphed decode steps (batch 1 and batch 32) on a
random-weight Llama shape, by the time each adds to the step (`timeline`), with their summed durations,
launches per step, the GPU's idle time and the step's wall time. With --kv and --context, steps over a
cache of that kind holding that many tokens (batch 1): where a compressed cache's step time goes.

Run (on a GPU machine): python bench/profile_cuda.py [--shape 1b|8b] [--formats bf16,q4_0] [--host]
[--kv f16,tq4] [--context 16384]
"""
from __future__ import annotations

import argparse
import collections
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository: bench/ and tests/fixtures

import torch
from torch.profiler import ProfilerActivity, profile

from bench.llm_cuda import BATCH, PROMPT_TOKENS, SHAPES, prompt
from tests.fixtures.decoders import random_llama

STEPS = 20


def decode_steps(model, rows: int, context: int = 0):
    """A function running one decode step for `rows` sequences whose prompts are already cached (or whose
    caches hold `context` tokens: their values do not matter, attention reads them all the same)."""
    from soma_runtime.engine.generate.engine import Stream
    from soma_runtime.engine.generate.sampling import greedy_rows
    from soma_runtime.engine.kv import Sequence
    engine = model.engine
    if context:
        seqs = [Sequence() for _ in range(rows)]
        for seq in seqs:
            engine.pool.reserve(seq, context + 1)

        def step():
            for seq in seqs:
                seq.length = context
            engine.forward([(seq, [1], 1) for seq in seqs], greedy_rows(rows))
        return step, lambda: [engine.pool.release(seq) for seq in seqs]
    streams = [Stream(engine, model.request([int(t) for t in row], 256, temperature=0)) for row in prompt(1000, rows)]
    for s in streams:
        s.start()
        engine.forward([(s.seq, s.take(PROMPT_TOKENS), 1)])
    step = lambda: engine.forward([(s.seq, [1], 1) for s in streams], greedy_rows(rows))
    return step, lambda: [engine.pool.release(s.seq) for s in streams]


def host_profile(step) -> None:
    """The Python functions a decode step spends its host time in (the GPU idles meanwhile)."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [step() for _ in range(STEPS * 5)])
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


def launches(events) -> list[tuple[str, float, float, float]]:
    """Kernels in launch order: (name, duration, time added to the step, idle time before it). Under PDL a
    kernel starts early and waits for the one before, so durations overlap and their sum overstates a
    step: a kernel adds its end past the later of its start and every earlier kernel's end."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    result, last = [], spans[0][0] if spans else 0.0
    for start, end, name in spans:
        result.append((name, end - start, max(0.0, end - max(start, last)), max(0.0, start - last)))
        last = max(last, end)
    return result


def timeline(events) -> tuple[dict, float]:
    """Per kernel name: (launches, summed durations, time added to the step), and the GPU's idle time.
    A kernel's added time is not what leaving it out would save: the 1B decode's kv_append adds 23.8 us a
    step, yet left out of steps whose attention kernel did its work too, it saved nothing (H200: 1082.5
    vs 1082.8 tok/s)."""
    kernels = collections.defaultdict(lambda: [0, 0.0, 0.0])
    idle = 0.0
    for name, duration, adds, gap in launches(events):
        idle += gap
        kernel = kernels[name]
        kernel[0] += 1
        kernel[1] += duration
        kernel[2] += adds
    return kernels, idle


def layer_block(names: list[str], layers: int) -> tuple[int, int]:
    """(kernels before the layers, kernels a layer) in one step's launch order: the first split whose
    `layers` blocks repeat one another."""
    for size in range(1, len(names) // layers + 1):
        for before in range(len(names) - layers * size + 1):
            if all(names[before + i] == names[before + i + size] for i in range((layers - 1) * size)):
                return before, size
    return len(names), 0


def in_order(events, steps: int, layers: int) -> list[tuple[str, float]]:
    """One step's kernels in launch order, each layer's as one block: (where and name, us added, averaged
    over steps and layers). The products are told apart here, where the table by name lumps them."""
    kernels = launches(events)
    per_step = len(kernels) // steps
    names = [name for name, *_ in kernels[:per_step]]
    before, size = layer_block(names, layers)
    rows = []
    for i, name in enumerate(names[:before + size] + names[before + layers * size:]):
        if i < before:
            where, at = "before", [i]
        elif i < before + size:
            where, at = "layer", [i + layer * size for layer in range(layers)]
        else:
            where, at = "after", [i + (layers - 1) * size]
        total = sum(kernels[step * per_step + j][2] for step in range(steps) for j in at)
        rows.append((f"{where:6s} {name[:60]}", total / steps / len(at)))
    return rows


def report(model, rows: int, host: bool, context: int = 0) -> None:
    step, release = decode_steps(model, rows, context)
    for _ in range(3):
        step()
    if host:
        host_profile(step)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / STEPS
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels, idle = timeline(events)
    busy = sum(k[2] for k in kernels.values())
    print(f"\nbatch {rows}: step {wall * 1e3:.3f} ms wall ({rows / wall:.0f} tok/s), GPU adds {busy / STEPS / 1e3:.3f} ms, "
          f"idle {idle / STEPS:.1f} us, {sum(k[0] for k in kernels.values()) / STEPS:.0f} kernels per step")
    print(f"  {'adds us':>9s}  {'runs us':>9s}  {'count':>5s}")
    for name, (n, duration, adds) in sorted(kernels.items(), key=lambda kv: -kv[1][2])[:16]:
        print(f"  {adds / STEPS:9.1f}  {duration / STEPS:9.1f}  {n / STEPS:5.0f}x  {name[:80]}")
    print(f"  one step in launch order, a layer's kernels averaged over its {model.loaded.config.num_layers} layers (us added):")
    for where, adds in in_order(events, STEPS, model.loaded.config.num_layers):
        print(f"  {adds:9.2f}  {where}")
    release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="bf16", help="comma-separated: bf16 (the model as written), q4_0 (converted)")
    ap.add_argument("--host", action="store_true", help="also profile the host side of batch-1 steps")
    ap.add_argument("--kv", default=None, help="comma-separated KV cache kinds (default: the format's own), batch 1")
    ap.add_argument("--context", type=int, default=0, help="tokens each sequence's cache holds (default: the prompt's)")
    args = ap.parse_args()
    from soma_runtime.convert import convert_hf_to_gguf
    from soma_runtime.tasks import Runtime
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        longer = {"max_position_embeddings": 2 * args.context} if args.context else {}
        random_llama({**SHAPES[args.shape], **longer}, path, "cuda")
        torch.cuda.empty_cache()
        formats = args.formats.split(",")
        paths = {name: path if name == "bf16" else convert_hf_to_gguf(path, os.path.join(tmp, f"model.{name}.gguf"), name)
                 for name in formats}
        for (name, path), kind in itertools.product(paths.items(), (args.kv or "").split(",")):
            cache = f" {kind or 'its own'} cache at {args.context or PROMPT_TOKENS} tokens"
            print(f"\n== {args.shape} {name}{cache}")
            model = Runtime("cuda").load(path, n_ctx=max(1024, args.context + 16), kv_dtype=kind or None, progress=False)
            for rows in (1,) if kind else (1, BATCH):
                report(model, rows, args.host and rows == 1, args.context)
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

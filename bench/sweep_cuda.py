"""Decode tiles swept where they run: each matrix-vector product of a random-weight Llama shape (bf16)
tried with other (rows, step width, warps) tiles inside captured, chained decode steps, against the
tiles linear.GEMV_TILES picks, the variants alternating in one process. Timed alone, a kernel ranks
tiles differently: the o projection follows attention in a step, not another o projection.

Run (on a GPU machine): python bench/sweep_cuda.py [--shape 1b|8b] [--products o,gate_up]
[--tiles 4x1024x2,8x512x2] [--rounds 2]; JSON in bench/out/sweep_cuda.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository: bench/ and tests/fixtures

import torch

from bench.llm_cuda import NEW_TOKENS, OUT, PROMPT_TOKENS, SHAPES
from tests.fixtures.decoders import random_llama

TILES = ((2, 2048, 2), (4, 1024, 2), (4, 2048, 4), (8, 512, 2), (8, 1024, 4), (16, 512, 4))


def products(shape: dict) -> dict[str, tuple[int, int]]:
    """A decoder's matrix-vector products as (rows N, row length K)."""
    D, I, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    H, KV = shape["num_attention_heads"], shape["num_key_value_heads"]
    return {"qkv": ((H + 2 * KV) * hd, D), "o": (D, H * hd), "gate_up": (2 * I, D), "down": (D, I),
            "head": (shape["vocab_size"], D)}


def decode_rate(model) -> float:
    """Greedy decode tok/s with fresh graphs (captured under the tiles in force)."""
    from soma_runtime.cli.bench import bench_model
    model.engine.stages[0].program.recapture()
    return bench_model(model, PROMPT_TOKENS, NEW_TOKENS, 3)["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--products", default="qkv,o,gate_up,down,head")
    ap.add_argument("--tiles", default=",".join("x".join(map(str, t)) for t in TILES), help="BNxBKxwarps, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from soma_runtime.backends.cuda import linear
    from soma_runtime.tasks import Runtime
    table = linear.gemv_tiles
    shapes = {name: nk for name, nk in products(SHAPES[args.shape]).items() if name in args.products.split(",")}
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    variants = [("table", None, None)] + [(name, nk, t) for name, nk in shapes.items() for t in tiles if t != table(*nk)]
    with tempfile.TemporaryDirectory() as tmp:
        random_llama(SHAPES[args.shape], tmp, "cuda")
        torch.cuda.empty_cache()
        model = Runtime("cuda").load(tmp, n_ctx=1024, progress=False)
        rates = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                _, nk, tile = variant
                linear.gemv_tiles = lambda N, K, nk=nk, tile=tile: tile if (N, K) == nk else table(N, K)
                rates[variant].append(decode_rate(model))
        linear.gemv_tiles = table
    base = statistics.mean(rates[variants[0]])
    print(f"\n{args.shape} bf16 greedy decode, tok/s per round; the table's tiles: {[round(r, 1) for r in rates[variants[0]]]}")
    print(f"{'product':8s} {'N x K':>13s} {'table':>10s} {'tried':>10s} {'tok/s':>16s} {'vs table':>8s}")
    rows = []
    for name, nk, tile in variants[1:]:
        mean = statistics.mean(rates[name, nk, tile])
        rows.append({"product": name, "N": nk[0], "K": nk[1], "table": table(*nk), "tried": tile, "tok_s": rates[name, nk, tile],
                     "vs_table": mean / base})
        shown = " / ".join(f"{r:.1f}" for r in rates[name, nk, tile])
        print(f"{name:8s} {nk[0]:6d}x{nk[1]:<6d} {'x'.join(map(str, table(*nk))):>10s} {'x'.join(map(str, tile)):>10s} "
              f"{shown:>16s} {mean / base:8.3f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sweep_cuda.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape,
                                                                "table_tok_s": rates[variants[0]], "tried": rows}, indent=1))


if __name__ == "__main__":
    main()

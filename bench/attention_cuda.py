"""The paged attention kernel alone, at a random Llama-3.2-1B's decode shape (32 query heads on 8 kv heads
of 64 dims, one row): microseconds per layer and the cache bytes read per second, f16 against tq4 and tq3
pages at 4k, 16k and 64k tokens of context, then sweeps of its tiling (context slots a tile, pipeline
stages, warps) and of how many programs share the context, at 64k. The L2 is flushed before each call
(each layer reads its own pages). Where the compressed kinds trail f16, this says whether more tiles in
flight or a cheaper decode is what they need (bench/kv_cache.py --speed has the whole decode step).
Run (on a GPU): python bench/attention_cuda.py; JSON in bench/out/attention-cuda.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from triton.testing import do_bench

from soma_runtime.backends.cuda import attention
from soma_runtime.quant import kv

OUT = Path(__file__).parent / "out"
HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 64, 16
CONTEXTS = (4096, 16384, 65536)
TILINGS = ((16, 4, 4), (32, 2, 4), (32, 3, 4), (32, 4, 4), (64, 3, 4), (64, 3, 8), (128, 2, 8), (128, 3, 8))
SHARES = (256, 512, 1024, 2048)


def pages(kind: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values for `tokens` slots: f16 values, or a codec's blocks of random codes under unit scales."""
    if kind == "none":
        keys = torch.randn(tokens // BLOCK, BLOCK, KV_HEADS, DIM, device="cuda").half()
        return keys, torch.randn_like(keys)
    codec = kv.CODECS[kind]
    data = torch.randint(0, 256, (tokens // BLOCK, BLOCK, KV_HEADS, codec.type_size * DIM // 32), dtype=torch.uint8,
                         device="cuda")
    for b in range(DIM // 32):                               # each block's f16 scale: 1.0
        data[..., b * codec.type_size], data[..., b * codec.type_size + 1] = 0x00, 0x3C
    return data, data.clone()


def microseconds(kind: str, tokens: int) -> tuple[float, float]:
    """The kernel's median time for one decode row over `tokens` of context, and the cache bytes it reads."""
    keys, values = pages(kind, tokens)
    q = torch.randn(1, HEADS, DIM, device="cuda")
    slots = torch.arange(tokens, device="cuda", dtype=torch.int32)
    codecs = {} if kind == "none" else {"k_codec": kind, "v_codec": kind}

    def call():
        attention.paged_attention(q, keys, values, slots, None, None, **codecs)
    call()
    return do_bench(call, warmup=20, rep=100, return_mode="median") * 1e3, 2 * keys.numel() * keys.element_size()


def measure(label: str, kind: str, tokens: int, results: dict) -> None:
    us, read = microseconds(kind, tokens)
    results[f"{label} {kind} {tokens}"] = {"us": us, "GB_s": read / us / 1e3}
    print(f"{label:24s} {kind:5s} {tokens:6d} tokens: {us:8.1f} us  {read / us / 1e3:7.0f} GB/s", flush=True)


def main() -> None:
    results: dict = {}
    tiling, programs = attention.tiling, attention.PROGRAMS
    for tokens in CONTEXTS:
        for kind in ("none", "tq4", "tq3"):
            measure("as shipped", kind, tokens, results)
    for kind in ("none", "tq4"):
        for tile in TILINGS:
            attention.tiling = lambda width, shares, tile=tile: tile
            measure(f"tiling {tile}", kind, CONTEXTS[-1], results)
        attention.tiling = tiling
        for count in SHARES:
            attention.PROGRAMS = count
            measure(f"{count} programs", kind, CONTEXTS[-1], results)
        attention.PROGRAMS = programs
    OUT.mkdir(exist_ok=True)
    (OUT / "attention-cuda.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()

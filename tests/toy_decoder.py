"""A 12-layer toy llama-style decoder built with the graph builder (random f32 weights)."""
from __future__ import annotations

import numpy as np

from soma_runtime.ir.graph import Graph, GraphBuilder


def toy_decoder(layers=12, dim=32, heads=4, kv_heads=2, hidden=64, vocab=50, seed=0) -> Graph:
    rng = np.random.default_rng(seed)
    hd = dim // heads

    def weight(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    g = GraphBuilder()
    ids = g.input("ids", ("S",), "i64")
    positions = g.input("positions", ("S",), "i64")
    inv_freq = g.const("inv_freq", (10000.0 ** (-np.arange(0, hd, 2) / hd)).astype(np.float32))
    x = g.embedding(g.const("embed", weight(vocab, dim)), ids)
    for i in range(layers):
        h = g.rmsnorm(x, g.const(f"l{i}.attn_norm", 1 + 0.1 * weight(dim)), eps=1e-5)
        q = g.reshape(g.matmul(h, g.const(f"l{i}.wq", weight(dim, dim)), transpose_b=True), shape=("S", heads, hd))
        k = g.reshape(g.matmul(h, g.const(f"l{i}.wk", weight(kv_heads * hd, dim)), transpose_b=True), shape=("S", kv_heads, hd))
        v = g.reshape(g.matmul(h, g.const(f"l{i}.wv", weight(kv_heads * hd, dim)), transpose_b=True), shape=("S", kv_heads, hd))
        q, k = g.rope(q, positions, inv_freq), g.rope(k, positions, inv_freq)
        heads_first = [g.reshape(g.transpose(t, dim0=0, dim1=1), shape=(1, n, "S", hd))
                       for t, n in ((q, heads), (k, kv_heads), (v, kv_heads))]
        attn = g.sdpa(*heads_first, causal=True)
        attn = g.reshape(g.transpose(g.reshape(attn, shape=(heads, "S", hd)), dim0=0, dim1=1), shape=("S", dim))
        x = g.add(x, g.matmul(attn, g.const(f"l{i}.wo", weight(dim, dim)), transpose_b=True))
        h = g.rmsnorm(x, g.const(f"l{i}.mlp_norm", 1 + 0.1 * weight(dim)), eps=1e-5)
        gate = g.matmul(h, g.const(f"l{i}.w_gate", weight(hidden, dim)), transpose_b=True)
        up = g.matmul(h, g.const(f"l{i}.w_up", weight(hidden, dim)), transpose_b=True)
        x = g.add(x, g.matmul(g.swiglu(gate, up), g.const(f"l{i}.w_down", weight(dim, hidden)), transpose_b=True))
    logits = g.matmul(g.rmsnorm(x, g.const("norm", np.ones(dim, np.float32))), g.const("head", weight(vocab, dim)), transpose_b=True)
    return g.output(logits)

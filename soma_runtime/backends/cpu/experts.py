"""CPU jets for mixture-of-experts: the router (scores, top-k, weights) and the grouped expert MLP.

The expert MLP gathers the rows routed to each expert and runs only the chosen experts: under q8
activations on 32-weight blocks, as llama.cpp's block dots over every chosen expert in one parallel
pass (qdot.grouped_matmul_q8); otherwise each expert's gate, up and down products go through the
matmul jet on its slice of the merged weights (blocks decoded in the kernel, never expanded whole).
"""
from __future__ import annotations

import numpy as np

from soma_runtime.backends.cpu import qdot
from soma_runtime.backends.cpu.common import CPU, INT, F, deliver, f32
from soma_runtime.backends.cpu.elementwise import swiglu
from soma_runtime.backends.cpu.linear import matmul
from soma_runtime.dtypes import QUANTIZED, QTensor, dtype_of
from soma_runtime.ir.jets import jet


@jet("router", CPU, [(F, "none"), (F, "f32")])
def router(logits, bias=None, out=None, top_k=2, scoring="softmax", normalize=False):
    z = f32(logits)
    if scoring == "softmax":
        scores = np.exp(z - z.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-z))
    choice = scores if bias is None else scores + bias
    index = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]       # ties keep the lower index, as the atoms
    weights = np.take_along_axis(scores, index, axis=-1)
    if normalize:
        weights /= weights.sum(axis=-1, keepdims=True)
    return deliver(weights, dtype_of(logits)), index.astype(np.int64)


def expert(w, e: int):
    """Expert e's [out, in] matrix of merged experts [E, out, in]: a view, blocks left as stored."""
    if isinstance(w, QTensor):
        rows = w.shape[1]
        return QTensor(w.data[e * rows:(e + 1) * rows].reshape(-1), w.dtype, w.shape[1:])
    return w[e]


EXPERT_WEIGHTS = (*F, *QUANTIZED)


@jet("moe_ffn", CPU, [(F, F, INT, w, w, w) for w in EXPERT_WEIGHTS])
def moe_ffn(x, weights, experts, gate, up, down, out=None, activations="f32"):
    rows = f32(x).reshape(-1, x.shape[-1])
    k = experts.shape[-1]
    chosen = experts.reshape(-1)
    order = np.argsort(chosen, kind="stable")                 # routed (token, slot) pairs grouped by expert
    bounds = np.searchsorted(chosen[order], np.arange(gate.shape[0] + 1))
    tokens, scale = order // k, f32(weights).reshape(-1)[order]
    if grouped(activations, gate, up, down):
        y = grouped_experts(rows[tokens], bounds, gate, up, down)
    else:
        y = np.empty((len(order), rows.shape[1]), np.float32)
        for e in np.flatnonzero(np.diff(bounds)):
            pairs = slice(bounds[e], bounds[e + 1])
            h = rows[tokens[pairs]]
            hidden = swiglu(matmul(h, expert(gate, e), transpose_b=True, activations=activations),
                            matmul(h, expert(up, e), transpose_b=True, activations=activations))
            y[pairs] = matmul(hidden, expert(down, e), transpose_b=True, activations=activations)
    result = np.zeros(rows.shape, np.float32)
    np.add.at(result, tokens, y * scale[:, None])             # each token's experts summed in expert order
    return deliver(result, dtype_of(x), out)


def grouped(activations, *ws) -> bool:
    """Whether the experts run as llama.cpp's q8 block dots, every expert in one parallel pass."""
    return activations == "q8" and all(isinstance(w, QTensor) and w.dtype.ggml_id in qdot.FORMATS for w in ws)


def grouped_experts(h, bounds, gate, up, down):
    """The SwiGLU experts on rows `h` grouped by expert (bounds[e]..bounds[e + 1]: expert e's rows)."""
    active = np.flatnonzero(np.diff(bounds))
    starts = np.append(bounds[active], bounds[-1])
    ffn, hidden = gate.shape[1], down.shape[1]
    g = qdot.grouped_matmul_q8(h, gate.data, gate.dtype.ggml_id, ffn, starts, active)
    u = qdot.grouped_matmul_q8(h, up.data, up.dtype.ggml_id, ffn, starts, active)
    return qdot.grouped_matmul_q8(swiglu(g, u), down.data, down.dtype.ggml_id, hidden, starts, active)

"""Mixture-of-experts ops: `router` (which experts each token goes to, with what weight) and
`moe_ffn` (the chosen experts' gated MLPs, their outputs summed by those weights).

Their decompositions are the dense definitions: every expert applied to every token and all but the
chosen ones weighted by zero. Jets run only the chosen ones (tokens gathered per expert).
"""
from __future__ import annotations

from soma_runtime.dtypes import dtype
from soma_runtime.ir.graph import TensorMeta, same_dim
from soma_runtime.ir.ops.base import check, dequant_if_needed, float_dtype, matmul_nk, op, sigmoid_atoms, softmax_atoms
from soma_runtime.ir.ops.elementwise import swiglu

SCORINGS = ("softmax", "sigmoid")


def router_rule(metas, attrs):
    logits, bias = metas[0], metas[1] if len(metas) > 1 else None
    dt = float_dtype(logits, "router logits")
    check(logits.ndim == 2, f"router takes logits [tokens, experts], got {list(logits.shape)}")
    check(attrs["scoring"] in SCORINGS, f"scoring must be one of {', '.join(SCORINGS)}, got {attrs['scoring']!r}")
    experts = logits.shape[1]
    if isinstance(experts, int):
        check(1 <= attrs["top_k"] <= experts, f"top_k={attrs['top_k']} out of range for {experts} experts")
    if bias is not None:
        check(bias.dtype == "f32" and bias.ndim == 1 and same_dim(bias.shape[0], experts) is not False,
              f"the choice bias must be f32 [{experts}], got {bias.dtype} {list(bias.shape)}")
    shape = (logits.shape[0], attrs["top_k"])
    return [TensorMeta(shape, dt), TensorMeta(shape, "i64")]


@op("router", ["logits", "bias?"], router_rule, attrs={"top_k": 2, "scoring": "softmax", "normalize": False},
    struct={"scoring": SCORINGS, "normalize": (False, True)}, ranks=(2, 1))
def router(A, logits, bias, top_k, scoring, normalize):
    """Each token's `top_k` experts (highest score first, ties to the lower index) and their weights:
    scores are softmax or sigmoid of the logits; a `bias` (DeepSeek-V3's balancing correction) moves
    the choice, never the weights; `normalize` rescales the chosen weights to sum to 1."""
    scores = softmax_atoms(A, logits, -1) if scoring == "softmax" else sigmoid_atoms(A, logits)
    choice = scores if bias is None else A.add(scores, bias)
    index = A.reduce("topk", choice, axis=-1, k=top_k)
    weights = A.read("take_along", scores, index, axis=-1)
    if normalize:
        weights = A.mul(weights, A.exp("recip", A.reduce("sum", weights, axis=-1)))
    return weights, index


def moe_ffn_rule(metas, attrs):
    x, weights, experts, gate, up, down = metas
    dt = float_dtype(x, "activation")
    check(x.ndim == 2, f"moe_ffn takes x as [tokens, hidden], got {list(x.shape)}")
    float_dtype(weights, "expert weights")
    check(experts.dtype in ("i32", "i64"), f"expert indices must be integer, got {experts.dtype}")
    check(weights.ndim == 2 and experts.ndim == 2
          and all(same_dim(a, b) is not False for a, b in zip(weights.shape, experts.shape)),
          f"expert weights {list(weights.shape)} and indices {list(experts.shape)} must be one [tokens, k] shape")
    check(same_dim(weights.shape[0], x.shape[0]) is not False, f"{weights.shape[0]} routed rows for {x.shape[0]} tokens")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        check(w.ndim == 3, f"{name} experts must be [experts, out, in], got {list(w.shape)}")
        if not dtype(w.dtype).quantized:
            float_dtype(w, f"{name} experts")
    n, f, d = gate.shape
    check(all(same_dim(a, b) is not False for a, b in zip(up.shape, gate.shape)),
          f"up experts {list(up.shape)} differ from gate experts {list(gate.shape)}")
    check(same_dim(d, x.shape[1]) is not False, f"experts take {d} inputs, x has {x.shape[1]}")
    check(all(same_dim(a, b) is not False for a, b in zip(down.shape, (n, d, f))),
          f"down experts must be [{n}, {d}, {f}], got {list(down.shape)}")
    check(attrs["activations"] in ("f32", "q8"), f"activations must be f32 or q8, got {attrs['activations']!r}")
    return [TensorMeta(tuple(x.shape), dt)]


@op("moe_ffn", ["x", "weights", "experts", "gate", "up", "down"], moe_ffn_rule, attrs={"activations": "f32"},
    tol=4.0, ranks=(2, 2, 2, 3, 3, 3))
def moe_ffn(A, x, weights, experts, gate, up, down, activations):
    """sum over k of weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = experts[t, k]:
    each expert a SwiGLU MLP with weights [out, in] (GGUF's merged `ffn_*_exps`). `activations="q8"`
    lets a kernel quantize an expert's inputs as the matmul op does."""
    rows = A.read("expand", x, axis=0)                                            # [1, T, D]
    hidden = swiglu(A, matmul_nk(A, rows, dequant_if_needed(A, gate)), matmul_nk(A, rows, dequant_if_needed(A, up)))
    outputs = matmul_nk(A, hidden, dequant_if_needed(A, down))                    # [E, T, D]
    chosen = A.cmp("eq", A.read("expand", experts, axis=-1), A.read("iota", n=gate.shape[0], axis=2, ndim=3))
    mix = A.reduce("sum", A.mul(chosen, A.read("expand", weights, axis=-1)), axis=1, keepdims=False)   # [T, E]
    mix = A.read("expand", A.read("transpose", mix, axis1=0, axis2=1), axis=-1)                       # [E, T, 1]
    return A.reduce("sum", A.mul(mix, outputs), axis=0, keepdims=False)

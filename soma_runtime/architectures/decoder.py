"""The transformer decoder template: DecoderConfig + weights -> one Graph, read top to bottom.

embed -> N x (norm, attention over the paged KV cache, norm, gated mlp) -> norm -> head.
Graph inputs: token `ids`, their `positions`, the cache `slots` they are written to, the
`ctx_slots` attention reads, additive attention masks [1, 1, S, T] (one per window size), each row's
`spans` of the context (its sequence's segment), the `logit_rows` whose logits are wanted, their
`sampling` rows (the `sample` op's params) and per layer the K/V pages. Outputs: logits [R, vocab],
each row's chosen token [R] (temperature 0: the most likely; a stream sampled where the model runs
reads only these), then every layer's updated K and V pages. Rows are independent except through the masks, so one graph
serves a prompt, a decode step, or a continuous batch of many sequences' rows.
"""
from __future__ import annotations

import numpy as np

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.dtypes import QTensor
from soma_runtime.errors import ModelLoadError
from soma_runtime.ir.graph import Graph, GraphBuilder
from soma_runtime.memory import release


class Weights:
    """Canonical-name tensor lookup that says which tensor is missing and where it came from."""

    def __init__(self, tensors: dict, source: str):
        self.tensors, self.source = tensors, source

    def __contains__(self, name):
        return name in self.tensors

    def __getitem__(self, name):
        if name not in self.tensors:
            raise ModelLoadError(f"{self.source}: missing tensor {name!r}")
        return self.tensors[name]


def expected_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The shape every decoder tensor must have, from the config (GGUF-style names, [out, in])."""
    D, H, KV, hd, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {"token_embd.weight": (cfg.vocab_size, D), "output_norm.weight": (D,), "output.weight": (cfg.vocab_size, D)}
    for i in range(cfg.num_layers):
        p = f"blk.{i}"
        shapes.update({f"{p}.attn_norm.weight": (D,), f"{p}.attn_q.weight": (H * hd, D), f"{p}.attn_k.weight": (KV * hd, D),
                       f"{p}.attn_v.weight": (KV * hd, D), f"{p}.attn_qkv.weight": ((H + 2 * KV) * hd, D),
                       f"{p}.attn_q.bias": (H * hd,), f"{p}.attn_k.bias": (KV * hd,), f"{p}.attn_v.bias": (KV * hd,),
                       f"{p}.attn_output.weight": (D, H * hd), f"{p}.attn_q_norm.weight": (hd,), f"{p}.attn_k_norm.weight": (hd,),
                       f"{p}.post_attention_norm.weight": (D,), f"{p}.ffn_norm.weight": (D,), f"{p}.post_ffw_norm.weight": (D,),
                       f"{p}.ffn_gate.weight": (F, D), f"{p}.ffn_down.weight": (D, F)})
        shapes[f"{p}.ffn_up.weight"] = (F, D)
    return shapes


def check_shapes(cfg: DecoderConfig, weights: Weights) -> None:
    """A tensor whose shape disagrees with the config is a corrupt or mismatched file: say which."""
    for name, want in expected_shapes(cfg).items():
        if name not in weights:
            continue
        got = tuple(weights[name].shape)
        if name.endswith("ffn_up.weight") and f"{name[:-len('ffn_up.weight')]}ffn_gate.weight" not in weights:
            want = (2 * want[0], want[1])                      # gate and up fused (phi3)
        if got != want:
            raise ModelLoadError(f"{weights.source}: tensor {name!r} has shape {list(got)}, the config needs {list(want)}")


def stack_rows(tensors: list, interleave: bool = False):
    """Weights [N_i, K] of one storage type stacked into one [sum N_i, K] (None if types differ); with
    `interleave`, weights of equal N alternate row by row (row 0 of each, then row 1 of each, ...)."""
    join = (lambda parts: np.stack(parts, axis=1).reshape(-1, parts[0].shape[-1])) if interleave else np.concatenate
    if interleave and len({t.shape for t in tensors}) != 1:
        return None
    if isinstance(tensors[0], QTensor):
        if len({(t.dtype.name, t.shape[1:]) for t in tensors if isinstance(t, QTensor)}) != 1 or \
                not all(isinstance(t, QTensor) for t in tensors):
            return None
        rows = sum(t.shape[0] for t in tensors)
        stacked = QTensor(join([t.data for t in tensors]), tensors[0].dtype, (rows, *tensors[0].shape[1:]))
    elif len({(np.asarray(t).dtype, np.shape(t)[1:]) for t in tensors}) == 1:
        stacked = join([np.asarray(t) for t in tensors])
    else:
        return None
    for t in tensors:                                  # the originals are never read again
        release(t.data if isinstance(t, QTensor) else np.asarray(t))
    return stacked


def row_halves(t) -> list:
    """A weight's first and second halves of rows (phi3's fused gate and up), as views."""
    half = t.shape[0] // 2
    if isinstance(t, QTensor):
        return [QTensor(t.data[rows], t.dtype, (half, *t.shape[1:])) for rows in (slice(0, half), slice(half, None))]
    return [np.asarray(t)[:half], np.asarray(t)[half:]]


def fuse_projections(cfg: DecoderConfig, weights: Weights) -> Weights:
    """q/k/v as one attn_qkv, and gate/up as one ffn_up with their rows interleaved (gate row i, then
    up row i: a gated matmul epilogue's column pairs), where their storage types agree: one matmul
    reads the shared input once, one pass quantizes it, and it applies the activation itself. Phi3's
    fused ffn_up (gate rows, then up rows) is interleaved the same way. The copies replace mmap pages
    that are then never touched, so resident memory stays the same."""
    fused = dict(weights.tensors)
    for i in range(cfg.num_layers):
        p = f"blk.{i}"
        parts = [f"{p}.attn_{n}.weight" for n in "qkv"]
        biases = [f"{p}.attn_{n}.bias" for n in "qkv"]
        with_bias = {b in fused for b in biases}          # all three biases or none
        if all(n in fused for n in parts) and len(with_bias) == 1 and (stacked := stack_rows([fused[n] for n in parts])) is not None:
            if True in with_bias:
                fused[f"{p}.attn_qkv.bias"] = np.concatenate([as_f32(fused.pop(b)) for b in biases])
            fused[f"{p}.attn_qkv.weight"] = stacked
            for n in parts:
                del fused[n]
        gate, up = f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight"
        if up not in fused:
            continue
        parts = [fused[gate], fused[up]] if gate in fused else row_halves(fused[up])
        if (stacked := stack_rows(parts, interleave=True)) is not None:
            fused.pop(gate, None)
            fused[up] = stacked
    return Weights(fused, weights.source)


SAMPLE_WIDTH = 64


def as_f32(t):
    return np.asarray(t, dtype=np.float32)


def spans_name(window: int) -> str:
    """The input giving each row the context positions it sees under a sliding `window` (0: none)."""
    return f"spans_w{window}" if window else "spans"


def build_decoder(cfg: DecoderConfig, weights: Weights, kv_dtype: str = "f32", activations: str = "f32") -> Graph:
    """`kv_dtype` is the cache's precision; `activations="q8"` lets matmuls with block-quantized weights
    quantize their inputs as llama.cpp does (see the matmul op)."""
    check_shapes(cfg, weights)
    g = GraphBuilder()
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ids = g.input("ids", ("S",), "i64")
    positions = g.input("positions", ("S",), "i64")
    slots = g.input("slots", ("S",), "i64")
    ctx = g.input("ctx_slots", ("T",), "i64")
    # causal attention, windowed or not, sees a contiguous run of each row's context: spans, not masks
    spans = {w: g.input(spans_name(w), ("S", 2), "i64") for w in sorted({cfg.window(i) for i in range(cfg.num_layers)})}
    logit_rows = g.input("logit_rows", ("R",), "i64")
    sampling = g.input("sampling", ("R", 5), "f32")

    made = {}

    def const(name, f32=False):
        """A weight as a graph constant, once however often it is read (tied embeddings, shared norms)."""
        if (name, f32) not in made:
            made[name, f32] = g.const(name, as_f32(weights[name]) if f32 else weights[name])
        return made[name, f32]

    def linear(x, name, residual=None, norm=None, epilogue="none"):
        """epilogue(x @ W.T (+ bias)) (+ residual); with `norm`, of rmsnorm(x) by that weight (a pre-norm block's input)."""
        bias = const(f"{name}.bias", f32=True) if f"{name}.bias" in weights else None
        norm_weight = None if norm is None else const(f"{norm}.weight", f32=True)
        return g.matmul(x, const(f"{name}.weight"), bias, residual, norm_weight, transpose_b=True, activations=activations,
                        epilogue=epilogue, norm_eps=cfg.rms_norm_eps)

    def joined(x, y, name, post_norm):
        """The residual stream x joined by a block's output projection `name` of y: added inside the
        matmul, or after the block's own norm (sandwich norms)."""
        if not cfg.sandwich_norms:
            return linear(y, name, residual=x)
        return g.add(x, norm(linear(y, name), post_norm))

    def norm(x, name):
        return g.rmsnorm(x, const(f"{name}.weight", f32=True), eps=cfg.rms_norm_eps)

    x = g.embedding(const("token_embd.weight"), ids)
    if x.dtype != "f32":
        x = g.cast(x, dtype="f32")
    if cfg.embed_scale != 1.0:
        x = g.mul(x, g.const("embed_scale", np.full(1, cfg.embed_scale, np.float32)))
    pages_out = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}"
        k_pages = g.input(f"k_pages.{i}", ("P", "BLK", KV, hd), kv_dtype)
        v_pages = g.input(f"v_pages.{i}", ("P", "BLK", KV, hd), kv_dtype)
        # a projection fused in one matrix takes the block's norm itself; separate ones share one norm
        if f"{p}.attn_qkv.weight" in weights:
            q, k, v = g.split(linear(x, f"{p}.attn_qkv", norm=f"{p}.attn_norm"), sizes=(H * hd, KV * hd, KV * hd), axis=-1)
        else:
            h = norm(x, f"{p}.attn_norm")
            q, k, v = (linear(h, f"{p}.attn_{n}") for n in "qkv")
        q, k, v = (g.reshape(t, shape=("S", n, hd)) for t, n in ((q, H), (k, KV), (v, KV)))
        if cfg.qk_norm:
            q, k = norm(q, f"{p}.attn_q_norm"), norm(k, f"{p}.attn_k_norm")
        inv_freq = cfg.inv_freq(i)
        if "rope_freqs.weight" in weights:            # llama-3 GGUF: scaling stored as per-dim factors
            inv_freq = inv_freq / as_f32(weights["rope_freqs.weight"])
        freqs = g.const(f"{p}.inv_freq", inv_freq.astype(np.float32))
        # rope rides along: keys are rotated as they are stored (values beside them), queries as attention loads them
        k_pages, v_pages = g.kv_append(k_pages, k, slots, positions, freqs, v_pages, v, style=cfg.rope_style)
        pages_out += [k_pages, v_pages]
        attn = g.paged_attention(q, k_pages, v_pages, ctx, None, spans[cfg.window(i)], positions, freqs, scale=cfg.attn_scale,
                                 softcap=cfg.attn_softcap, rope_style=cfg.rope_style)
        x = joined(x, g.reshape(attn, shape=("S", H * hd)), f"{p}.attn_output", f"{p}.post_attention_norm")
        gated = "swiglu" if cfg.activation == "silu" else "geglu_tanh"
        if f"{p}.ffn_gate.weight" in weights:
            h = norm(x, f"{p}.ffn_norm")
            gate, up = linear(h, f"{p}.ffn_gate"), linear(h, f"{p}.ffn_up")
            act = g.swiglu(gate, up) if gated == "swiglu" else g.geglu(gate, up, approximate="tanh")
        else:                                         # gate and up fused in one matrix, rows interleaved (fuse_projections)
            act = linear(x, f"{p}.ffn_up", norm=f"{p}.ffn_norm", epilogue=gated)
        x = joined(x, act, f"{p}.ffn_down", f"{p}.post_ffw_norm")
    x = g.embedding(x, logit_rows)                    # the rows that sample a token: the head reads only those
    head = "token_embd" if cfg.tie_embeddings or "output.weight" not in weights else "output"
    logits = linear(x, head, norm="output_norm")
    if cfg.final_softcap:
        cap = cfg.final_softcap
        logits = g.mul(g.tanh(g.mul(logits, g.const("softcap_inv", np.full(1, 1 / cap, np.float32)))),
                       g.const("softcap", np.full(1, cap, np.float32)))
    return g.output(logits, g.sample(logits, sampling, width=sample_width(cfg)), *pages_out)


def sample_width(cfg: DecoderConfig) -> int:
    """The candidates the graph's sampler sees: enough for llama.cpp's and HF's default top-k (40, 50)."""
    return min(SAMPLE_WIDTH, cfg.vocab_size)


"""Mixture-of-experts decoders: what differs from the dense decoder template, and nothing else.

A MoE family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) is the decoder with its MLP replaced, in the
layers that route, by a router over `num_experts` SwiGLU experts (top-k, softmax or sigmoid scores,
optionally renormalized) plus, for Qwen2-MoE, a shared expert behind a sigmoid gate. `MoEConfig` is
read from a HF config.json or GGUF metadata; `build_moe_ffn` is the layer's graph; per-expert tensors
(HF's, older GGUFs') are stacked here into GGUF's merged `ffn_{gate,up,down}_exps` [experts, out, in].
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from soma_runtime.architectures.fields import MAX_LAYERS, MAX_SIZE, OPTIONAL_SIZE, SIZE, Field, check_fields
from soma_runtime.dtypes import QTensor
from soma_runtime.errors import ModelLoadError

EXPERTS = Field(int, 1, 4096, required=True)
HF_MOE_FIELDS = {"num_experts_per_tok": SIZE, "moe_intermediate_size": OPTIONAL_SIZE,
                 "shared_expert_intermediate_size": Field(int, 0, MAX_SIZE), "decoder_sparse_step": Field(int, 1, MAX_LAYERS)}
GGUF_MOE_FIELDS = {"expert_count": EXPERTS, "expert_used_count": SIZE, "expert_feed_forward_length": OPTIONAL_SIZE,
                   "expert_shared_feed_forward_length": Field(int, 0, MAX_SIZE), "expert_gating_func": Field(int, 0, 2)}
GGUF_GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}      # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE (0: unset)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_size: int                        # each routed expert's intermediate width
    scoring: str = "softmax"                # softmax | sigmoid
    normalize: bool = False                 # the chosen weights rescaled to sum to 1 (norm_topk_prob)
    shared_size: int = 0                    # the shared expert's intermediate width (0: none)
    dense_layers: frozenset = frozenset()   # layers that keep a dense MLP

    def routes(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def validate(self, source: str) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise ModelLoadError(f"{source}: top-k of {self.top_k} experts per token exceeds the {self.num_experts} experts")
        return self


def moe_config_from_hf(hf: dict, traits: dict, source: str) -> MoEConfig | None:
    """The routing fields of a HF config.json (None for a dense family)."""
    if "moe" not in traits:
        return None
    check_fields(hf, {**HF_MOE_FIELDS, "num_experts": EXPERTS} if "num_experts" in hf else
                 {**HF_MOE_FIELDS, "num_local_experts": EXPERTS}, source)
    step = hf.get("decoder_sparse_step", 1)
    layers = range(hf["num_hidden_layers"])
    dense = {i for i in layers if i in set(hf.get("mlp_only_layers") or ()) or (i + 1) % step}
    return MoEConfig(
        num_experts=hf.get("num_experts") or hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
        normalize=hf.get("norm_topk_prob", traits["moe"].get("normalize", False)),
        shared_size=hf.get("shared_expert_intermediate_size", 0),
        dense_layers=frozenset(dense),
    ).validate(source)


def moe_config_from_gguf(meta: dict, arch: str, tensor_names: set[str], traits: dict, n_layers: int,
                         source: str) -> MoEConfig | None:
    """The routing fields of GGUF metadata (llama.cpp's keys); None for a file without experts. Layers
    without a router tensor keep a dense MLP."""
    if not meta.get(f"{arch}.expert_count") and "blk.0.ffn_gate_inp.weight" not in tensor_names:
        return None
    check_fields(meta, {f"{arch}.{key}": field for key, field in GGUF_MOE_FIELDS.items()}, source)

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)
    normalize = get("expert_weights_norm")
    return MoEConfig(
        num_experts=get("expert_count"),
        top_k=get("expert_used_count"),
        expert_size=get("expert_feed_forward_length") or get("feed_forward_length"),
        scoring=GGUF_GATING[get("expert_gating_func", 0)],
        normalize=bool(traits.get("moe", {}).get("normalize", False) if normalize is None else normalize),
        shared_size=get("expert_shared_feed_forward_length", 0) or (
            get("feed_forward_length") if "blk.0.ffn_up_shexp.weight" in tensor_names else 0),
        dense_layers=frozenset(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
    ).validate(source)


def expected_shapes(moe: MoEConfig, hidden: int, n_layers: int) -> dict[str, tuple[int, ...]]:
    """The shape of every routing tensor (GGUF names, [experts, out, in] for the merged experts)."""
    E, F, S, D = moe.num_experts, moe.expert_size, moe.shared_size, hidden
    shapes = {}
    for i in filter(moe.routes, range(n_layers)):
        p = f"blk.{i}"
        shapes.update({f"{p}.ffn_gate_inp.weight": (E, D), f"{p}.ffn_gate_exps.weight": (E, F, D),
                       f"{p}.ffn_up_exps.weight": (E, F, D), f"{p}.ffn_down_exps.weight": (E, D, F)})
        if S:
            shapes.update({f"{p}.ffn_gate_shexp.weight": (S, D), f"{p}.ffn_up_shexp.weight": (S, D),
                           f"{p}.ffn_down_shexp.weight": (D, S)})
    return shapes


def check_expert_shapes(moe: MoEConfig, hidden: int, n_layers: int, weights) -> None:
    """Every routing tensor present and of the config's shape; a file whose experts disagree with its
    expert count says both."""
    for name, want in expected_shapes(moe, hidden, n_layers).items():
        got = tuple(weights[name].shape)
        if got != want and got[1:] == want[1:] and name.endswith(("_exps.weight", "ffn_gate_inp.weight")):
            raise ModelLoadError(f"{weights.source}: tensor {name!r} holds {got[0]} experts, the config says "
                                 f"{moe.num_experts} (expert_count)")
        if got != want:
            raise ModelLoadError(f"{weights.source}: tensor {name!r} has shape {list(got)}, the config needs {list(want)}")
    for i in filter(moe.routes, range(n_layers)) if moe.shared_size else ():
        name = f"blk.{i}.ffn_gate_inp_shexp.weight"
        if tuple(weights[name].shape) not in ((hidden,), (1, hidden)):        # llama.cpp's vector, HF's [1, hidden]
            raise ModelLoadError(f"{weights.source}: tensor {name!r} has shape {list(weights[name].shape)}, "
                                 f"the config needs [{hidden}]")


def build_moe_ffn(g, moe: MoEConfig, h, p: str, const, linear, activations: str):
    """Layer `p`'s routed MLP on the normed rows `h`: router, the chosen experts, the shared expert."""
    weights, experts = g.router(linear(h, f"{p}.ffn_gate_inp"), top_k=moe.top_k, scoring=moe.scoring,
                                normalize=moe.normalize)
    y = g.moe_ffn(h, weights, experts, *(const(f"{p}.ffn_{n}_exps.weight") for n in ("gate", "up", "down")),
                  activations=activations)
    if not moe.shared_size:
        return y
    shared = linear(g.swiglu(linear(h, f"{p}.ffn_gate_shexp"), linear(h, f"{p}.ffn_up_shexp")), f"{p}.ffn_down_shexp")
    gate = g.sigmoid(g.reduce_sum(g.mul(h, const(f"{p}.ffn_gate_inp_shexp.weight", f32=True)), axes=(-1,), keepdims=True))
    return g.add(y, g.mul(shared, gate))


# --- per-expert tensors (HF checkpoints, older GGUFs) -> merged -------------------------------------

HF_EXPERT = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
HF_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
GGUF_SPLIT_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")     # llama.cpp's files before merged experts


def stack_hf_experts(tensors: dict, source: str) -> tuple[dict, dict]:
    """(merged experts by GGUF name, the other tensors): each layer's experts 0..E-1 stacked."""
    found: dict[str, dict[int, np.ndarray]] = {}
    rest = {}
    for name, t in tensors.items():
        m = HF_EXPERT.match(name)
        if m is None or m.group(3) not in HF_EXPERT_PARTS:
            rest[name] = t
            continue
        layer, index, part = m.groups()
        found.setdefault(f"blk.{layer}.ffn_{HF_EXPERT_PARTS[part]}_exps.weight", {})[int(index)] = t
    return merged(found, source), rest


def merge_split_experts(tensors: dict, source: str) -> dict:
    """A GGUF's tensors with one tensor per expert (`blk.N.ffn_gate.E.weight`) merged into llama.cpp's
    `ffn_*_exps` (a copy of those blocks); other files' tensors as they are."""
    found: dict[str, dict[int, object]] = {}
    rest = {}
    for name, t in tensors.items():
        m = GGUF_SPLIT_EXPERT.match(name)
        if m is None:
            rest[name] = t
            continue
        layer, part, index = m.groups()
        found.setdefault(f"blk.{layer}.ffn_{part}_exps.weight", {})[int(index)] = t
    return {**rest, **merged(found, source)} if found else tensors


def merged(found: dict[str, dict[int, object]], source: str) -> dict:
    """Each name's experts 0..E-1 as one [E, out, in] tensor: stored blocks concatenated, arrays stacked."""
    out = {}
    for name, by_index in found.items():
        missing = sorted(set(range(max(by_index) + 1)) - set(by_index))
        if missing:
            raise ModelLoadError(f"{source}: {name} lacks expert {missing[0]} (has {len(by_index)} of {max(by_index) + 1})")
        parts = [by_index[j] for j in range(len(by_index))]
        if len({(str(getattr(p, "dtype", None)), tuple(p.shape)) for p in parts}) != 1:
            raise ModelLoadError(f"{source}: the experts of {name} differ in shape or type")
        first = parts[0]
        if isinstance(first, QTensor):
            out[name] = QTensor(np.concatenate([p.data.reshape(-1) for p in parts]), first.dtype, (len(parts), *first.shape))
        else:
            out[name] = np.stack([np.asarray(p) for p in parts])
    return out

"""LoRA adapters as a decoder sees them: low-rank factors by the base's module (canonical names, as the
template's linear layers are named), checked against the base's config and weights.

Owns what an adapter is once read (LoraAdapter) and whether it fits a base: its modules exist and are
the template's linear layers (q, k, v or qkv, o, gate, up or gate_up, down), its factors' shapes and ranks
agree with their weights, its numbers are finite. Knows nothing of files (loaders/lora.py reads them) or
of how adapters are batched (engine/generate/lora.py).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.registry import permute_for_interleaved_rope
from soma_runtime.architectures.weights import Weights
from soma_runtime.dtypes import QTensor
from soma_runtime.errors import ModelLoadError
from soma_runtime.quant import dequantize

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")   # linear kinds
MAX_RANK = 1024                     # a rank beyond this is no low-rank adapter
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class LoraFactors:
    """One module's update: a [rank, in] and b [out, rank] (its scale folded in), so x -> (x a.T) b.T; with
    DoRA, `magnitude` [out]: m / ||W + s B A|| per output row, multiplying the module's whole product."""
    a: np.ndarray
    b: np.ndarray
    magnitude: np.ndarray | None = None

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter by the base module it changes ("blk.3.attn_q"): its factors at the strength `alpha` it was
    read at (folded into b, and into DoRA's magnitudes, which depend on it), the rank of the widest."""
    name: str
    source: str
    modules: dict[str, LoraFactors]
    alpha: float = 1.0

    @property
    def dora(self) -> bool:
        return any(f.magnitude is not None for f in self.modules.values())

    @property
    def rank(self) -> int:
        return max(f.rank for f in self.modules.values())

    @property
    def parameters(self) -> int:
        return sum(f.a.size + f.b.size for f in self.modules.values())


def merged(weight, factors: LoraFactors) -> np.ndarray:
    """A linear layer's weight [out, in] with the update folded in, f32: W + b a (DoRA: each output row then
    times its magnitude)."""
    w = np.asarray(dequantize(weight) if isinstance(weight, QTensor) else weight, np.float32)
    w = w + factors.b @ factors.a
    return w if factors.magnitude is None else w * factors.magnitude[:, None]


def check_name(name) -> str:
    """An adapter's name: 1 to 64 of A-Z a-z 0-9 . _ -, not starting with a dot (so never `..`)."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise ModelLoadError(f"an adapter name is 1 to 64 of A-Z a-z 0-9 . _ - not starting with '.' and without '..', "
                             f"got {name!r}")
    return name


def check_rank(rank, where: str) -> int:
    if type(rank) is not int or not 1 <= rank <= MAX_RANK:
        raise ModelLoadError(f"{where}: rank must be an integer in [1, {MAX_RANK}], got {rank!r}")
    return rank


def check_scale(scale, where: str) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ModelLoadError(f"{where}: scale must be a finite number, got {scale!r}")
    return float(scale)


def factors(cfg: DecoderConfig, weights: Weights, module: str, a, b, scale: float, rank: int, magnitude,
            source: str, hf_rows: bool = True) -> LoraFactors:
    """The checked factors of `module` ("blk.3.attn_q") from lora_A [rank, in], lora_B [out, rank] (and DoRA's
    magnitude [out]); ModelLoadError naming the module where they do not fit the base. `hf_rows`: B's rows
    are in HF's order (PEFT's), which a GGUF llama base's q/k rows are not."""
    where = f"{source}: module {module}"
    parts = module.split(".")
    layer = int(parts[1]) if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() else -1
    if not 0 <= layer < cfg.num_layers or parts[2] not in TARGETS:
        raise ModelLoadError(f"{where} is not a linear layer a LoRA may change here ({', '.join(TARGETS)} of "
                             f"{cfg.num_layers} layers)")
    if f"{module}.weight" not in weights:
        raise ModelLoadError(f"{where}: the base has no {module}.weight (its projections are fused)")
    out, inp = weights[f"{module}.weight"].shape
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != (rank, inp) or b.shape != (out, rank):
        raise ModelLoadError(f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the base's "
                             f"[{out}, {inp}] weight at rank {rank} (an adapter of another base?)")
    if rank > min(out, inp):
        raise ModelLoadError(f"{where}: rank {rank} exceeds the weight's [{out}, {inp}]")
    a, b = a.astype(np.float32), b.astype(np.float32) * np.float32(scale)
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(parts[2])
    interleaved = hf_rows and heads is not None and cfg.rope_style == "interleaved"   # a GGUF llama's q/k rows
    if interleaved:
        b = permute_for_interleaved_rope(b, heads)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ModelLoadError(f"{where}: the factors hold values that are not finite")
    if magnitude is not None:
        magnitude = np.asarray(magnitude, np.float32)
        if magnitude.shape != (out,) or not np.isfinite(magnitude).all():
            raise ModelLoadError(f"{where}: DoRA's magnitude must be {out} finite values, got {list(magnitude.shape)}")
        magnitude = permute_for_interleaved_rope(magnitude, heads) if interleaved else magnitude
        norm = np.linalg.norm(merged(weights[f"{module}.weight"], LoraFactors(a, b)), axis=1)
        magnitude = (magnitude / np.where(norm > 0, norm, 1)).astype(np.float32)
    return LoraFactors(np.ascontiguousarray(a), np.ascontiguousarray(b), magnitude)

"""Megatron's split of a decoder over a tensor-parallel group: the config and weights one rank holds.

Each rank gets its share of the attention heads (q, k, v by rows, o by columns) and of the MLP's
columns (gate, up by rows, down by columns), and a share of the vocabulary's rows of the head; the
embedding, norms and the row-parallel products' biases (added once, after the ranks' sum) are whole
on every rank. Quantized weights split on their blocks' boundaries; a slice of a memory-mapped tensor
copies only the rank's part. Knows decoder weights by name, nothing of processes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.decoder import check_shapes
from soma_runtime.architectures.weights import Weights
from soma_runtime.dtypes import QTensor
from soma_runtime.errors import ParallelError


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of a group of `ranks`; `vocab` is the rows of the head it computes."""
    rank: int
    ranks: int
    vocab: range

    def part(self, n: int, unit: int = 1) -> slice:
        """This rank's even share of n units of `unit` rows or columns."""
        share = n // self.ranks * unit
        return slice(self.rank * share, (self.rank + 1) * share)


def rows(t, parts: list[slice]):
    """The rows `parts` of a weight [out, in] or a bias [out], in order, as one array (copied)."""
    data = t.data if isinstance(t, QTensor) else np.asarray(t)
    taken = np.concatenate([data[p] for p in parts]) if len(parts) > 1 else np.array(data[parts[0]])
    if isinstance(t, QTensor):
        return QTensor(taken.reshape(-1), t.dtype, (len(taken), *t.shape[1:]))
    return taken


def columns(t, part: slice, name: str):
    """The columns `part` of a weight [out, in] (copied); a quantized one's on its blocks' boundaries."""
    if not isinstance(t, QTensor):
        return np.array(np.asarray(t)[:, part])
    block, size = t.dtype.block_size, t.dtype.type_size
    if part.start % block or part.stop % block:
        raise ParallelError(f"{name}: columns {part.start}:{part.stop} of {t.dtype.name} blocks of {block} cannot be "
                            f"split there; use fewer ranks")
    data = np.array(t.data[:, part.start // block * size: part.stop // block * size])
    return QTensor(data.reshape(-1), t.dtype, (t.shape[0], part.stop - part.start))


def check_split(cfg: DecoderConfig, source: str, ranks: int) -> None:
    """ParallelError where the model's heads or MLP cannot be shared evenly by `ranks`."""
    if type(ranks) is not int or ranks < 1:
        raise ParallelError(f"tensor_parallel must be a whole number of ranks >= 1, got {ranks!r}")
    for count, what in ((cfg.num_heads, "attention heads"), (cfg.num_kv_heads, "kv heads"),
                        (cfg.intermediate_size, "MLP columns")):
        if count % ranks:
            raise ParallelError(f"{source}: {count} {what} cannot be shared by {ranks} ranks")


def shard(cfg: DecoderConfig, weights: Weights, rank: int, ranks: int) -> tuple[DecoderConfig, Weights, Shard]:
    """Rank `rank`'s config (its heads and MLP columns), weights and shard (check_split's errors)."""
    H, KV, hd, F, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    check_split(cfg, weights.source, ranks)
    check_shapes(cfg, weights)
    share = -(-V // ranks)
    s = Shard(rank, ranks, range(min(V, rank * share), min(V, (rank + 1) * share)))
    q, k, f = s.part(H, hd), s.part(KV, hd), s.part(F)
    local = {}
    for name, t in weights.tensors.items():
        kind = name.split(".", 2)[-1]
        if kind in ("attn_q.weight", "attn_q.bias"):
            local[name] = rows(t, [q])
        elif kind in ("attn_k.weight", "attn_k.bias", "attn_v.weight", "attn_v.bias"):
            local[name] = rows(t, [k])
        elif kind == "attn_qkv.weight":                       # q, k and v stacked (phi3)
            local[name] = rows(t, [q, offset(k, H * hd), offset(k, (H + KV) * hd)])
        elif kind == "attn_output.weight":
            local[name] = columns(t, q, name)
        elif kind in ("ffn_gate.weight", "ffn_up.weight"):
            fused = kind == "ffn_up.weight" and name.replace("ffn_up", "ffn_gate") not in weights
            local[name] = rows(t, [f, offset(f, F)] if fused else [f])    # gate and up stacked (phi3)
        elif kind == "ffn_down.weight":
            local[name] = columns(t, f, name)
        elif name not in ("output.weight", "output.bias"):
            local[name] = t
    head = "token_embd" if cfg.tie_embeddings or "output.weight" not in weights else "output"
    vocab = slice(s.vocab.start, s.vocab.stop)
    local["output.weight"] = rows(weights[f"{head}.weight"], [vocab])
    if f"{head}.bias" in weights and head == "output":
        local["output.bias"] = rows(weights["output.bias"], [vocab])
    mine = replace(cfg, num_heads=H // ranks, num_kv_heads=KV // ranks, intermediate_size=F // ranks, tie_embeddings=False)
    return mine, Weights(local, f"{weights.source} (rank {rank} of {ranks})"), s


def offset(part: slice, by: int) -> slice:
    return slice(part.start + by, part.stop + by)

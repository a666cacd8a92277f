"""Where a decoder's layers run: all on one backend, or split across devices as llama.cpp's
--n-gpu-layers splits them (the first layers, with the embedding, on the device; the rest, with the
head, on the host). Each stage is a graph of its layers (DecoderIO says which) run as a Program of its
own (its plans, placed weights and captures); a step runs the stages in order, the hidden rows passing
from one to the next.
Knows graphs, plans and backends; nothing of sequences or scheduling.
"""
from __future__ import annotations

from collections import Counter

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.contract import DecoderIO, DecoderOutputs, DecoderStep, LoraStep, PagedKV, kv_index
from soma_runtime.architectures.decoder import build_decoder
from soma_runtime.architectures.weights import Weights
from soma_runtime.errors import RequestError
from soma_runtime.ir.backend import Backend
from soma_runtime.ir.plan import Plan
from soma_runtime.ir.program import Program


class Stage:
    """A run of consecutive layers on one backend: its graph's Program (plans per (rows, logit rows), the
    context a free dim; weights placed on the backend once; captured steps). With a `shard`, the layers of
    one tensor-parallel rank (architectures/shard.py)."""

    def __init__(self, cfg: DecoderConfig, weights: Weights, cache: PagedKV, layers: range, backend: Backend,
                 activations: str, shard=None, lora: dict[str, tuple[int, int]] | None = None):
        self.backend, self.io = backend, DecoderIO(cache, layers, cfg.hidden_size, lora)
        self.program = Program(build_decoder(cfg, weights, self.io, activations, shard), backend, free=("T",))

    @property
    def layers(self) -> range:
        return self.io.layers

    @property
    def graph(self):
        return self.program.graph

    @property
    def fusions(self):
        return self.program.fusions

    def share_weights(self, other: Stage) -> None:
        """Read the weights `other` placed on the device (a draft of this model's first layers), placing none
        of its own; before its first plan."""
        self.program.placed = other.program.placed

    def context(self, rows: int, needed: int) -> int:
        """The context a step of `rows` rows over `needed` positions runs with (captured steps pad it)."""
        return self.program.captures.context(rows, needed)

    def bindings(self, rows: int, logit_rows: int, pages, lora: LoraStep | None) -> dict[str, int]:
        sizes = {"S": rows, "R": logit_rows, "P": pages.shape[0], "BLK": pages.shape[1]}
        if self.io.lora:                     # the adapter slots and their padded rank
            sizes["LN"], sizes["LR"] = next(iter(lora.factors.values()))[0].shape[:2]
        return sizes

    def plan(self, rows: int, logit_rows: int, pages, lora: LoraStep | None = None) -> Plan:
        """The plan of a step of `rows` rows, `logit_rows` of them wanted, over KV pages shaped as `pages`
        (and adapter stacks shaped as `lora`'s, where its graph takes adapters)."""
        return self.program.plan(self.bindings(rows, logit_rows, pages, lora))

    def run(self, step: DecoderStep, logit_rows: int, context: int) -> DecoderOutputs:
        """One step of this stage's layers (`step.pages`: every layer's; `step.hidden`: the rows the stage
        before gave, where this one does not start at the embedding)."""
        rows = len(step.attention.positions)
        bindings = self.bindings(rows, logit_rows, step.pages[kv_index(self.layers.start, 0)], step.lora)
        return self.io.read(self.program.step(bindings, self.io.feed(step), self.io.shared(), rows, context))

    def layer_weights(self) -> list:
        """Its layers' weights as the fused graph holds them (q/k/v stacked, ...)."""
        return [w for name, w in self.graph.constants.items() if name.startswith("blk.")]


def split(cfg: DecoderConfig, backend: Backend, device_layers: int | None) -> list[tuple[range, Backend]]:
    """The layers each stage runs and where: all on `backend` (device_layers None, or every layer), or the
    first `device_layers` there and the rest on its host (0: all on the host)."""
    n = cfg.num_layers
    if device_layers is None or device_layers >= n:
        return [(range(n), backend)]
    if type(device_layers) is not int or device_layers < 0:
        raise RequestError(f"gpu_layers must be an integer >= 0, got {device_layers!r}")
    host = backend.fallback
    if host is None:
        raise RequestError(f"gpu_layers: the {backend.name} backend runs on the host; there is no device to split from")
    return [(range(n), host)] if device_layers == 0 else [(range(device_layers), backend), (range(device_layers, n), host)]


def stage_bytes(cfg: DecoderConfig, weights: Weights, cache: PagedKV, layers: range, slots: int) -> int:
    """What a stage of `layers` holds: their weights (the final norm and head with the last layer, the
    embedding and the rest with the first) and their KV pages of `slots` tokens."""
    def stage_of(name: str) -> int:
        if name.startswith("blk."):
            return int(name.split(".")[1])
        return cfg.num_layers - 1 if name.startswith(("output.", "output_norm.")) else 0
    held = sum(int(w.nbytes) for name, w in weights.tensors.items() if stage_of(name) in layers)
    return held + cache.token_bytes(layers) * slots


def fusions(stages: list[Stage]) -> Counter:
    return sum((Counter(s.fusions) for s in stages), Counter())

"""The adapters one decoder runs at run time: LoRA slots its graph reads, every adapted module's factors of
every loaded adapter stacked ([slots, rank, in], [slots, out, rank], DoRA's [slots, out]) and padded to
the widest rank loaded; which adapter a sequence runs under (a Variant), and the rows' index and scale a
step feeds (contract.LoraStep).

An adapter is written into a free slot when it loads and its slot is freed when it is unloaded and no
sequence runs under it any more, so a running request never sees its factors change. Knows adapters as
architectures/lora.py gives them, nothing of files, requests' wire forms or kernels.
"""
from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass

import numpy as np

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.contract import LoraStep
from soma_runtime.architectures.lora import TARGETS, LoraAdapter
from soma_runtime.architectures.weights import Weights
from soma_runtime.engine.kv import Variant
from soma_runtime.errors import RequestError

MAX_SCALE = 1000.0           # a request's scale beyond this is no adapter strength
KEYS = itertools.count(1)    # prefix-cache keys, never reused within a process


@dataclass
class Loaded:
    """A loaded adapter: its slot in the stacks, its prefix-cache key."""
    adapter: LoraAdapter
    slot: int
    key: int


class LoraTable:
    """`modules`: the adapted modules ("blk.3.attn_q") with their (in, out) sizes; `slots`: how many
    adapters it holds at once."""

    def __init__(self, modules: dict[str, tuple[int, int]], slots: int):
        if type(slots) is not int or not 1 <= slots <= 1024:
            raise RequestError(f"max_loras must be an integer in [1, 1024], got {slots!r}")
        self.modules, self.slots = modules, slots
        self.loaded: dict[str, Loaded] = {}
        self.users = [0] * slots                 # sequences running under each slot's adapter
        self.retired: set[int] = set()           # slots of unloaded adapters still in use
        self.lock = threading.Lock()
        self.factors = self.stacks(1)

    @property
    def nbytes(self) -> int:
        """The slots' stacks, every module's (what max_loras adapters of the widest rank loaded take)."""
        return sum(t.nbytes for stack in self.factors.values() for t in stack)

    @property
    def rank(self) -> int:
        return next(iter(self.factors.values()))[0].shape[1]

    def stacks(self, rank: int) -> dict[str, tuple]:
        """Empty stacks at `rank` (zero factors, unit magnitudes), each loaded adapter written back in."""
        stacks = {m: (np.zeros((self.slots, rank, k), np.float32), np.zeros((self.slots, n, rank), np.float32),
                      np.ones((self.slots, n), np.float32)) for m, (k, n) in self.modules.items()}
        for loaded in self.loaded.values():
            self.write(stacks, loaded.slot, loaded.adapter)
        return stacks

    def write(self, stacks: dict, slot: int, adapter: LoraAdapter) -> None:
        for m, (a, b, magnitude) in stacks.items():
            a[slot], b[slot], magnitude[slot] = 0, 0, 1
            f = adapter.modules.get(m)
            if f is not None:
                a[slot, :f.rank], b[slot, :, :f.rank] = f.a, f.b
                if f.magnitude is not None:
                    magnitude[slot] = f.magnitude

    def add(self, adapter: LoraAdapter) -> None:
        """Load `adapter` into a free slot; RequestError where its name is taken, none is free, or it changes a
        module this graph has no adapter op for."""
        missing = sorted(set(adapter.modules) - set(self.modules))
        if missing:
            raise RequestError(f"adapter {adapter.name}: this model's graph takes no adapter on {', '.join(missing[:4])}")
        with self.lock:
            free = self.room(adapter.name)
            loaded = Loaded(adapter, free, next(KEYS))
            if adapter.rank > self.rank:
                self.loaded[adapter.name] = loaded
                self.factors = self.stacks(adapter.rank)        # new arrays: a step in flight keeps the old ones
            else:
                self.write(self.factors, free, adapter)
                self.loaded[adapter.name] = loaded

    def room(self, name: str) -> int:
        """The slot an adapter named `name` would take; RequestError where the name is taken or none is free."""
        if name in self.loaded:
            raise RequestError(f"an adapter named {name!r} is loaded already; unload it first")
        taken = {x.slot for x in self.loaded.values()} | self.retired
        free = next((s for s in range(self.slots) if s not in taken), None)
        if free is None:
            raise RequestError(f"all {self.slots} adapter slots are taken (max_loras); unload one first")
        return free

    def check_room(self, name: str) -> None:
        with self.lock:
            self.room(name)

    def remove(self, name: str) -> None:
        with self.lock:
            loaded = self.loaded.pop(self.known(name), None)
            if self.users[loaded.slot]:
                self.retired.add(loaded.slot)

    def known(self, name) -> str:
        if name not in self.loaded:
            raise RequestError(f"no adapter named {name!r} is loaded (loaded: {', '.join(sorted(self.loaded)) or 'none'})")
        return name

    def check(self, name, scale) -> None:
        """RequestError unless `name` is loaded and `scale` a strength it runs at."""
        with self.lock:
            self.checked(name, scale)

    def checked(self, name, scale) -> Loaded:
        """The adapter `name` (the lock held). A DoRA adapter runs only at scale 1: its magnitudes were made for
        the strength it was loaded at."""
        scale = check_scale(scale, "lora scale")
        loaded = self.loaded[self.known(name)]
        if scale != 1 and loaded.adapter.dora:
            raise RequestError(f"adapter {name!r} is DoRA: it runs at the strength it was loaded at (lora scale 1); "
                               f"load it again with another alpha")
        return loaded

    def use(self, name: str, scale: float) -> Variant:
        """The Variant a sequence runs under this adapter at `scale` (times its alpha); held until `release`."""
        with self.lock:
            loaded = self.checked(name, scale)
            self.users[loaded.slot] += 1
            return Variant(loaded.slot, float(scale), hash((loaded.key, float(scale))))

    def release(self, variant: Variant) -> None:
        if variant.slot < 0:
            return
        with self.lock:
            self.users[variant.slot] -= 1
            if not self.users[variant.slot]:
                self.retired.discard(variant.slot)

    def step(self, variants: list[Variant], rows: list[int]) -> LoraStep:
        """A step's LoraStep: each item's rows under its variant."""
        index = np.repeat(np.fromiter((v.slot for v in variants), np.int64, len(variants)), rows)
        scale = np.repeat(np.fromiter((v.scale for v in variants), np.float32, len(variants)), rows)
        return LoraStep(index, scale, self.factors)

    def base_step(self, rows: int) -> LoraStep:
        return LoraStep(np.full(rows, -1, np.int64), np.zeros(rows, np.float32), self.factors)

    def listing(self) -> list[dict]:
        """The loaded adapters: name, alpha (strength), rank, parameters, source, modules."""
        return [{"name": name, "alpha": x.adapter.alpha, "rank": x.adapter.rank, "params": x.adapter.parameters,
                 "source": x.adapter.source, "modules": len(x.adapter.modules)} for name, x in sorted(self.loaded.items())]


def adapted_modules(cfg: DecoderConfig, weights: Weights) -> dict[str, tuple[int, int]]:
    """The modules a decoder's graph takes adapters on, with their (in, out) sizes: each layer's linear
    layers kept apart (TARGETS) in the base."""
    modules = {}
    for i in range(cfg.num_layers):
        for kind in TARGETS:
            if f"blk.{i}.{kind}.weight" in weights:
                out, inp = weights[f"blk.{i}.{kind}.weight"].shape
                modules[f"blk.{i}.{kind}"] = (inp, out)
    return modules


def check_scale(scale, what: str) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or abs(scale) > MAX_SCALE:
        raise RequestError(f"{what} must be a finite number within +-{MAX_SCALE:g}, got {scale!r}")
    return float(scale)

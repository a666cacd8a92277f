"""The adapters one decoder runs at run time: LoRA slots its graph reads, every adapted module's factors of
every loaded adapter stacked ([slots, rank, in], [slots, out, rank], DoRA's [slots, out]) and padded to
the widest rank loaded; which adapter a sequence runs under (a Variant), and the rows' index and scale a
step feeds (contract.LoraStep).

A table holds up to HELD_PER_SLOT x slots adapters in host memory; the slots hold those run lately: an adapter
is written into a slot when it loads (a free one, else the least recently used that no sequence runs under)
or, if none is idle then, when a sequence first runs under it. A slot is never rewritten while a sequence
runs under its adapter, so a running request never sees its factors change; an unloaded adapter's slot is
freed once none does. Knows adapters as architectures/lora.py gives them, nothing of files, requests' wire
forms or kernels.
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
HELD_PER_SLOT = 4            # adapters held in host memory per slot (the rest of them wait there for one)
UNSLOTTED = -1
KEYS = itertools.count(1)    # prefix-cache keys, never reused within a process


@dataclass
class Loaded:
    """A loaded adapter: its slot in the stacks (UNSLOTTED: held in host memory only), its prefix-cache key
    (its own for as long as it is loaded, whichever slot it is in)."""
    adapter: LoraAdapter
    slot: int
    key: int


class LoraTable:
    """`modules`: the adapted modules ("blk.3.attn_q") with their (in, out) sizes; `slots`: how many
    adapters run at once (HELD_PER_SLOT times as many are held)."""

    def __init__(self, modules: dict[str, tuple[int, int]], slots: int):
        if type(slots) is not int or not 1 <= slots <= 1024:
            raise RequestError(f"max_loras must be an integer in [1, 1024], got {slots!r}")
        self.modules, self.slots, self.held = modules, slots, HELD_PER_SLOT * slots
        self.loaded: dict[str, Loaded] = {}
        self.users = [0] * slots                 # sequences running under each slot's adapter
        self.retired: set[int] = set()           # slots of unloaded adapters still in use
        self.recent: dict[int, None] = {}        # the slots in order of last use, least recent first
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
        """Empty stacks at `rank` (zero factors, unit magnitudes), each slotted adapter written back in."""
        stacks = {m: (np.zeros((self.slots, rank, k), np.float32), np.zeros((self.slots, n, rank), np.float32),
                      np.ones((self.slots, n), np.float32)) for m, (k, n) in self.modules.items()}
        for loaded in self.loaded.values():
            if loaded.slot != UNSLOTTED:
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
        """Hold `adapter`, in a slot if one is idle; RequestError where its name is taken, the table holds all it
        may, or it changes a module this graph has no adapter op for."""
        missing = sorted(set(adapter.modules) - set(self.modules))
        if missing:
            raise RequestError(f"adapter {adapter.name}: this model's graph takes no adapter on {', '.join(missing[:4])}")
        with self.lock:
            self.room(adapter.name)
            loaded = self.loaded[adapter.name] = Loaded(adapter, UNSLOTTED, next(KEYS))
            slot = self.idle_slot()
            if slot is not None:
                self.place(loaded, slot)

    def room(self, name: str) -> None:
        """RequestError where an adapter named `name` could not be held: the name is taken, or the table is full."""
        if name in self.loaded:
            raise RequestError(f"an adapter named {name!r} is loaded already; unload it first")
        if len(self.loaded) >= self.held:
            raise RequestError(f"all {self.held} adapters this model holds are loaded ({HELD_PER_SLOT} x max_loras "
                               f"{self.slots}); unload one first")

    def check_room(self, name: str) -> None:
        with self.lock:
            self.room(name)

    def idle_slot(self) -> int | None:
        """A slot an adapter may be written into (the lock held): a free one, else the least recently used whose
        adapter no sequence runs under (that adapter goes back to waiting in host memory); None where every
        slot runs."""
        taken = {x.slot: x for x in self.loaded.values() if x.slot != UNSLOTTED}
        free = next((s for s in range(self.slots) if s not in taken and s not in self.retired), None)
        if free is not None:
            return free
        idle = next((s for s in [*self.recent, *range(self.slots)] if s in taken and not self.users[s]), None)
        if idle is not None:
            taken[idle].slot = UNSLOTTED
        return idle

    def place(self, loaded: Loaded, slot: int) -> None:
        """Write an adapter into `slot` (the lock held); a wider rank restacks (new arrays: a step in flight
        keeps the old ones)."""
        loaded.slot = slot
        self.recent.pop(slot, None)
        self.recent[slot] = None
        if loaded.adapter.rank > self.rank:
            self.factors = self.stacks(loaded.adapter.rank)
        else:
            self.write(self.factors, slot, loaded.adapter)

    def remove(self, name: str) -> None:
        with self.lock:
            loaded = self.loaded.pop(self.known(name), None)
            if loaded.slot != UNSLOTTED and self.users[loaded.slot]:
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
        """The Variant a sequence runs under this adapter at `scale` (times its alpha), its adapter put in a slot
        if it waits in host memory (RequestError where every slot runs another's sequences); held until
        `release`."""
        with self.lock:
            loaded = self.checked(name, scale)
            if loaded.slot == UNSLOTTED:
                slot = self.idle_slot()
                if slot is None:
                    raise RequestError(f"all {self.slots} adapter slots (max_loras) run other adapters' requests; "
                                       f"{name!r} waits in memory: try again when one ends")
                self.place(loaded, slot)
            self.users[loaded.slot] += 1
            self.recent.pop(loaded.slot, None)
            self.recent[loaded.slot] = None
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
        """The loaded adapters: name, alpha (strength), rank, parameters, source, modules, whether in a slot now."""
        return [{"name": name, "alpha": x.adapter.alpha, "rank": x.adapter.rank, "params": x.adapter.parameters,
                 "source": x.adapter.source, "modules": len(x.adapter.modules), "in_slot": x.slot != UNSLOTTED}
                for name, x in sorted(self.loaded.items())]


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

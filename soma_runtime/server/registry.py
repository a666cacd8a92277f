"""The models a server holds: loading within a memory budget, priorities, LRU eviction, hot-swap.

Each text generator gets its own continuous-batching Scheduler; encoders run one call at a time
under a lock. Loading a model that does not fit the budget first unloads loaded models of no
higher priority, least recently used first. Loading under the id of a running model is a hot-swap:
the new one is loaded beside it, new requests go to it from then on, and the old one finishes the
requests it holds before it is dropped. An unloaded model likewise drains before it goes.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from soma_runtime.api import EncoderModel, Model, Runtime
from soma_runtime.engine.batching import Scheduler
from soma_runtime.errors import RequestError

log = logging.getLogger("soma_runtime.server")


class ModelNotFound(RequestError):
    """A request named a model the server does not hold."""


class OutOfMemory(RequestError):
    """A model cannot fit the memory budget even after evicting what may be evicted."""


@dataclass
class Served:
    id: str
    model: Model | EncoderModel
    priority: int
    bytes: int
    source: str
    scheduler: Scheduler | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    loaded_at: float = field(default_factory=time.time)

    @property
    def is_generator(self) -> bool:
        return self.scheduler is not None

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def retire(self) -> None:
        """Finish what it holds (in a background thread), then let it go."""
        if self.scheduler is not None:
            threading.Thread(target=self.scheduler.close, name=f"drain-{self.id}", daemon=True).start()


def model_bytes(model: Model | EncoderModel) -> int:
    """Weights plus, for a generator, a full context of KV cache: what it may come to hold."""
    size = model.info()["weight_bytes"]
    if isinstance(model, Model):
        pool = model.engine.pool
        per_token = sum(k[0, 0].nbytes for k in pool.k) * 2
        size += per_token * model.engine.n_ctx
    return size


def default_budget() -> int:
    """80% of physical memory."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8)


def default_id(source: str | None) -> str:
    if not source:
        return "default"
    name = os.path.basename(os.path.normpath(source))
    return name.removesuffix(".gguf")


class ModelRegistry:
    def __init__(self, runtime: Runtime | None = None, memory_budget: int | None = None, max_batch: int = 16,
                 step_tokens: int = 256, n_ctx: int | None = None):
        self.runtime = runtime or Runtime()
        self.budget = memory_budget or default_budget()
        self.max_batch, self.step_tokens, self.n_ctx = max_batch, step_tokens, n_ctx
        self.models: dict[str, Served] = {}
        self.lock = threading.RLock()
        self.load_lock = threading.Lock()           # one load at a time; serving goes on meanwhile
        self.evicted = 0

    @property
    def used_bytes(self) -> int:
        return sum(s.bytes for s in self.models.values())

    def get(self, model_id: str | None) -> Served:
        with self.lock:
            if model_id not in self.models:
                raise ModelNotFound(f"model {model_id!r} is not loaded; loaded: {', '.join(self.models) or 'none'}")
            served = self.models[model_id]
            served.touch()
            return served

    def load(self, source: str | None, model_id: str | None = None, priority: int = 0) -> Served:
        """Load (or hot-swap) a model; `source` is a path or a bundled model name."""
        model_id = model_id or default_id(source)
        with self.load_lock:
            model = self.runtime.load(source, n_ctx=self.n_ctx, progress=False, model_id=model_id)
            size = model_bytes(model)
            with self.lock:
                old = self.models.get(model_id)
                self._make_room(size, priority, keep=model_id)
                served = Served(model_id, model, priority, size, source or "default")
                if isinstance(model, Model):
                    served.scheduler = Scheduler(model.engine, self.max_batch, self.step_tokens)
                self.models[model_id] = served
            if old is not None:
                log.info("hot-swapped %s: new requests go to %s; the old one drains", model_id, served.source)
                old.retire()
            log.info("loaded %s from %s (%.1f MB, priority %d)", model_id, served.source, size / 1e6, priority)
            return served

    def _make_room(self, size: int, priority: int, keep: str) -> None:
        if size > self.budget:
            raise OutOfMemory(f"the model needs {size / 1e6:.0f} MB, over the server's whole budget of {self.budget / 1e6:.0f} MB")
        victims = sorted((s for s in self.models.values() if s.id != keep and s.priority <= priority),
                         key=lambda s: (s.priority, s.last_used))
        while self.used_bytes + size > self.budget:
            if not victims:
                raise OutOfMemory(f"the model needs {size / 1e6:.0f} MB; {self.used_bytes / 1e6:.0f} of "
                                  f"{self.budget / 1e6:.0f} MB are held by models of higher priority")
            victim = victims.pop(0)
            log.info("unloading %s (priority %d) to make room", victim.id, victim.priority)
            self._drop(victim.id)
            self.evicted += 1

    def unload(self, model_id: str) -> None:
        with self.lock:
            self.get(model_id)
            self._drop(model_id)

    def _drop(self, model_id: str) -> None:
        served = self.models.pop(model_id)
        if self.runtime.models.get(model_id) is served.model:
            del self.runtime.models[model_id]
        served.retire()

    def close(self) -> None:
        """Cancel what is still running (the HTTP server has stopped taking requests)."""
        with self.lock:
            for served in self.models.values():
                if served.scheduler is not None:
                    served.scheduler.close(drain=False, timeout=10)

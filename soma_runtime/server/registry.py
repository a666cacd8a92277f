"""The models a server holds: loading within a memory budget, priorities, LRU eviction, hot-swap.

Each text generator runs its scheduling loop on a thread of its own; other models run one call at a
time under a lock. A model that does not fit the budget makes room down a ladder, each rung logged
and counted (`degradations`, in /v1/metrics and /v1/memory): first the KV caches, the largest first,
are compressed (f16 -> tq4 -> tq3, running requests' pages converted where they are), then loaded
models of no higher priority are unloaded, least recently used first, once they finish their
requests, then a new model on a device keeps there only the layers that fit (the rest run on the
host, llama.cpp's --n-gpu-layers), then the new model's context is cut to what fits. No admitted request is dropped; a model
that fits in none of these ways is refused (OutOfMemory). Loading under the id of a running model is a hot-swap:
the new one is loaded beside it, new requests go to it from then on, and the old one finishes the
requests it holds before it is dropped. An unloaded model likewise drains before it goes.
"""
from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from soma_runtime.engine.generate import Scheduler
from soma_runtime.errors import RequestError
from soma_runtime.ir.graph import Graph
from soma_runtime.memory import give_back_freed, settle_heap
from soma_runtime.server.security import check_model_id, safe_model_id
from soma_runtime.tasks import Model, Runtime, TextModel

log = logging.getLogger("soma_runtime.server")
DRAIN_SECONDS = 120        # how long a load waits for an unloaded model to finish its requests
MIN_CONTEXT = 256          # the shortest context the ladder cuts a new model's down to
DEGRADATIONS = ("compress_kv", "unload_model", "offload_layers", "reduce_context")      # the ladder's rungs, in order


class ModelNotFound(RequestError):
    """A request named a model the server does not hold."""


class OutOfMemory(RequestError):
    """A model cannot fit the memory budget even after evicting what may be evicted."""


@dataclass
class Served:
    id: str
    model: Model
    priority: int
    bytes: int
    source: str
    scheduler: Scheduler | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    drained: threading.Event = field(default_factory=threading.Event)
    last_used: float = field(default_factory=time.monotonic)
    loaded_at: float = field(default_factory=time.time)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def retire(self, done) -> None:
        """Finish what it holds (in a background thread), then let it go, call `done(self)` and set `drained`."""
        def drain():
            if self.scheduler is not None:
                self.scheduler.close()
            self.model.close()
            done(self)
            self.drained.set()
            settle_heap()                   # the model's cycles (plans, graphs) go now, not at some later collection
            give_back_freed()
        threading.Thread(target=drain, name=f"drain-{self.id}", daemon=True).start()


def default_budget() -> int:
    """80% of physical memory."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8)


def default_id(source: str | None) -> str:
    if not source:
        return "default"
    return safe_model_id(os.path.basename(os.path.normpath(source)).removesuffix(".gguf"))


class ModelRegistry:
    def __init__(self, runtime: Runtime | None = None, memory_budget: int | None = None, max_batch: int = 16,
                 step_tokens: int = 256, n_ctx: int | None = None, draft: str | None = None, overflow: str | None = None,
                 kv_dtype: str | None = None, gpu_layers: int | None = None, tensor_parallel: int = 1):
        """`draft`: speculative decoding for every text model loaded (Runtime.speculate); `overflow`: what
        they do with prompts beyond their context (TextModel); `kv_dtype`: their KV cache's type;
        `gpu_layers`: how many of their layers run on the device; `tensor_parallel`: over how many ranks
        each text model is split (Runtime.load)."""
        self.runtime = runtime or Runtime()
        self.draft, self.overflow, self.kv_dtype, self.gpu_layers = draft, overflow, kv_dtype, gpu_layers
        self.tensor_parallel = tensor_parallel
        if memory_budget is not None and not (isinstance(memory_budget, numbers.Integral) and memory_budget >= 1):
            raise RequestError(f"the memory budget must be a whole number of bytes, at least 1, got {memory_budget!r}")
        self.budget = memory_budget or default_budget()
        self.kv_tokens = 1 if memory_budget else None     # under a set budget a KV pool holds one sequence's most, so
        #                                                   what the budget counts is what is allocated (llama.cpp's -c)
        self.max_batch, self.step_tokens, self.n_ctx = max_batch, step_tokens, n_ctx
        self.models: dict[str, Served] = {}
        self.retiring: list[Served] = []             # unloaded or swapped out, finishing their requests
        self.lock = threading.RLock()
        self.load_lock = threading.Lock()           # one load at a time; serving goes on meanwhile
        self.evicted = 0
        self.degradations: Counter[str] = Counter()  # the ladder's rungs taken (DEGRADATIONS)

    @property
    def used_bytes(self) -> int:
        """What the models hold, counting those still finishing their requests."""
        with self.lock:
            return sum(s.bytes for s in [*self.models.values(), *self.retiring])

    def directories(self) -> set[str]:
        """The directories the served models' files are in (those still finishing requests included)."""
        with self.lock:
            paths = [s.model.path for s in [*self.models.values(), *self.retiring]]
        return {os.path.dirname(os.path.abspath(path)) for path in paths if os.path.exists(path)}

    def get(self, model_id: str | None) -> Served:
        with self.lock:
            if model_id not in self.models:
                raise ModelNotFound(f"model {model_id!r} is not loaded; loaded: {', '.join(self.models) or 'none'}")
            served = self.models[model_id]
            served.touch()
            return served

    def load(self, source: str | Graph | None, model_id: str | None = None, priority: int = 0,
             sha256: str | None = None) -> Served:
        """Load (or hot-swap) a model; `source` is a path or a bundled model name, checked against
        `sha256` where given, or a Graph built in code."""
        if model_id is None:
            model_id = "graph" if isinstance(source, Graph) else default_id(source)
        model_id = check_model_id(model_id)
        with self.load_lock:
            old = self.models.get(model_id)
            model = self.runtime.load(source, n_ctx=self.n_ctx, sha256=sha256, progress=False, model_id=model_id,
                                      overflow=self.overflow, kv_dtype=self.kv_dtype,
                                      gpu_layers=self.gpu_layers, kv_tokens=self.kv_tokens,
                                      tensor_parallel=1 if isinstance(source, Graph) else self.tensor_parallel)
            try:
                self._make_room(model, priority, keep=model_id)
                size = model.memory_bytes
            except BaseException:                   # not served: the runtime lets it go (and keeps the one it replaced)
                self.runtime.models.pop(model_id, None)
                model.close()
                if old is not None:
                    self.runtime.models[model_id] = old.model
                raise
            with self.lock:
                served = Served(model_id, model, priority, size, source if isinstance(source, str) else model.path)
                if model.task == "generate":
                    if self.draft is not None:
                        self.runtime.speculate(model, self.draft)
                    served.scheduler = model.serve(self.max_batch, self.step_tokens)
                old = self.models.get(model_id)
                self.models[model_id] = served
                if old is not None:
                    log.info("hot-swapped %s: new requests go to the new one; the old one drains", model_id)
                    self._retire(old)
            log.info("loaded %s from %s (%.1f MB, priority %d)", model_id, served.source, size / 1e6, priority)
            settle_heap()
            return served

    def _make_room(self, model: Model, priority: int, keep: str) -> None:
        """Go down the ladder (the module docstring) until `model` fits the budget beside the others."""
        while True:
            with self.lock:
                if self.used_bytes + model.memory_bytes <= self.budget:
                    return
                if self._compress_largest(model):
                    continue
                victims = sorted((s for s in self.models.values() if s.id != keep and s.priority <= priority),
                                 key=lambda s: (s.priority, s.last_used))
                if victims:
                    draining = victims[0]
                    self._degrade("unload_model", "unloading %s (priority %d) to make room", draining.id, draining.priority)
                    self._drop(draining.id)
                    self.evicted += 1
                elif self.retiring:
                    draining = self.retiring[0]
                elif self._offload_layers(model):
                    continue
                elif self._reduce_context(model):
                    return
                elif not self.used_bytes:
                    raise OutOfMemory(f"the model needs {model.memory_bytes / 1e6:.0f} MB at the least, over the server's "
                                      f"whole budget of {self.budget / 1e6:.0f} MB")
                else:
                    raise OutOfMemory(f"the model needs {model.memory_bytes / 1e6:.0f} MB; {self.used_bytes / 1e6:.0f} of "
                                      f"{self.budget / 1e6:.0f} MB are held by models of higher priority")
            if not draining.drained.wait(DRAIN_SECONDS):
                raise OutOfMemory(f"the model needs {model.memory_bytes / 1e6:.0f} MB, held by {draining.id!r}, which is "
                                  "still finishing its requests; try again shortly")

    def _compress_largest(self, new: Model) -> bool:
        """The first rung: the largest KV cache that can take a smaller kind re-encoded in it."""
        held = [(s.model, s) for s in self.models.values()] + [(new, None)]
        text = [(m, s) for m, s in held if isinstance(m, TextModel) and m.smaller_kv_kind() is not None]
        if not text:
            return False
        model, served = max(text, key=lambda pair: pair[0].kv_bytes_per_token * pair[0].engine.pool_tokens())
        kind = model.smaller_kv_kind()
        self._degrade("compress_kv", "compressing the KV cache of %s: %s -> %s", model.id, model.engine.kv_dtype, kind)
        model.recompress(kind)
        if served is not None:
            served.bytes = model.memory_bytes
        return True

    def _offload_layers(self, model: Model) -> bool:
        """The third rung: a new text model on a device keeps there the most layers (at least one) that fit
        the budget left with its context, or failing that with the shortest context the last rung may cut
        it to; the rest run on the host."""
        if not isinstance(model, TextModel) or model.backend.fallback is None or model.engine.shard is not None:
            return False
        room, engine = self.budget - self.used_bytes, model.engine
        for n_ctx in (engine.n_ctx, MIN_CONTEXT):
            fits = [k for k in range(1, engine.device_layers) if engine.memory_bytes(k, n_ctx) <= room]
            if fits:
                break
        else:
            return False
        self._degrade("offload_layers", "running %d of the %d layers of %s on the host", engine.cfg.num_layers - fits[-1],
                      engine.cfg.num_layers, model.id)
        model.offload(fits[-1])
        return True

    def _reduce_context(self, model: Model) -> bool:
        """The last rung: a new text model's context cut to what the budget leaves it (at least MIN_CONTEXT)."""
        if not isinstance(model, TextModel):
            return False
        engine, room = model.engine, self.budget - self.used_bytes
        if MIN_CONTEXT >= engine.n_ctx or engine.memory_bytes(n_ctx=MIN_CONTEXT) > room:
            return False
        n_ctx, over = MIN_CONTEXT, engine.n_ctx             # the longest context that fits: n_ctx fits, over does not
        while over - n_ctx > 1:
            middle = (n_ctx + over) // 2
            n_ctx, over = (middle, over) if engine.memory_bytes(n_ctx=middle) <= room else (n_ctx, middle)
        self._degrade("reduce_context", "cutting the context of %s: %d -> %d tokens", model.id, engine.n_ctx, n_ctx)
        model.limit_context(int(n_ctx))
        return True

    def _degrade(self, step: str, message: str, *args) -> None:
        self.degradations[step] += 1
        log.warning("memory budget: " + message, *args)

    def memory(self) -> dict:
        """The budget, what each model holds (its KV cache's kind, context and pool) and the ladder's rungs taken."""
        with self.lock:
            models = [{"id": s.id, "priority": s.priority, "bytes": s.bytes, "task": s.model.task,
                       **({"kv_cache": s.model.engine.kv_dtype, "kv_bytes_per_token": s.model.kv_bytes_per_token,
                           "context": s.model.engine.n_ctx, "kv_tokens": s.model.engine.pool_tokens(),
                           "gpu_layers": s.model.engine.device_layers}
                          if isinstance(s.model, TextModel) else {})}
                      for s in self.models.values()]
            return {"budget_bytes": self.budget, "used_bytes": self.used_bytes, "models": models,
                    "degradations": dict(self.degradations), "evicted": self.evicted}

    def remeasure(self, model_id: str) -> None:
        """A served model's bytes measured again (its LoRA adapters changed what it holds)."""
        with self.lock:
            served = self.get(model_id)
            served.bytes = served.model.memory_bytes

    def unload(self, model_id: str) -> None:
        with self.lock:
            self.get(model_id)
            self._drop(model_id)

    def _drop(self, model_id: str) -> None:
        served = self.models.pop(model_id)
        if self.runtime.models.get(model_id) is served.model:
            del self.runtime.models[model_id]
        self._retire(served)

    def _retire(self, served: Served) -> None:
        with self.lock:
            self.retiring.append(served)

        def gone(s: Served) -> None:
            with self.lock:
                self.retiring.remove(s)
        served.retire(gone)

    def close(self) -> None:
        """Cancel what is still running (the HTTP server has stopped taking requests)."""
        with self.lock:
            for served in self.models.values():
                if served.scheduler is not None:
                    served.scheduler.close(drain=False, timeout=10)
                served.model.close()

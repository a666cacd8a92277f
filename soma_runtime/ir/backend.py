"""The Backend interface: everything the runtime may ask of a place where ops run.

The runtime holds a Backend object (from schedule.py) and never imports a backend's modules: a
Plan takes one, and the engine asks its plan's. A backend's jets reach the runtime only through the
registry, filed under the backend's `name`. This base is the host's behaviour (numpy arrays in
memory the runtime can read); a device backend overrides what differs. It knows nothing of models:
`defaults` is told a model's task, format and stored dtype, nothing else.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from soma_runtime.dtypes import DTYPES


@dataclass(frozen=True)
class Precision:
    """How a model computes: its KV cache's dtype, and what matmul inputs may be rounded to (f32, bf16
    for matrix units, q8 for integer block dots)."""
    kv_dtype: str
    activations: str


def mapped_zeros(shape: tuple[int, ...], dtype_name: str) -> np.ndarray:
    """Zeros in memory mapped from the OS for this array alone: a page becomes resident when it is
    first written, and all of it goes back with the array (calloc would zero every page up front and
    keep a freed array resident)."""
    dt = DTYPES[dtype_name].numpy
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(mmap.mmap(-1, max(1, count * dt.itemsize)), dt, count=count).reshape(shape)


class Captures:
    """How a backend runs a model's repeated steps: as they are here; a device backend may capture a
    step once and replay it (a CUDA graph), padding the context so few captures serve every step."""

    def context(self, rows: int, needed: int) -> int:
        """The context length a step of `rows` rows over `needed` positions is run with."""
        return needed

    def run(self, plan, inputs: dict, shared: set, rows: int, context: int) -> list:
        """Run one step; `shared` inputs (KV pages) are the same tensors every step."""
        return plan.run(inputs)

    def replay(self, plan, inputs: dict) -> list:
        """Run a whole graph (an imported model's, an encoder's batch); a device backend captures a plan on
        its second run and replays it after."""
        return plan.run(inputs)

    def forget(self, plan) -> None:
        """Drop what was captured of a plan that will not run again."""


class Backend:
    name = "host"
    device = False             # tensors live off the host: constants are placed, results fetched
    host_arena = True          # intermediates live in a plan's host arena (else the device's allocator)
    asynchronous = False       # results come back while later work runs on (running ahead pays)
    formulas = False           # compiles a formula of elementwise atoms into one kernel (`generated`)
    compiles = False           # its kernels compile on first use: a model is warmed up at load (Engine.warm)

    @property
    def fallback(self) -> Backend | None:
        """Where ops without a jet here run (a device backend: the host), or None: their atoms run here."""
        return None

    def detect(self) -> dict:
        """What this backend found on this machine (`soma-runtime backends`)."""
        return {"available": True}

    def enter_thread(self) -> None:
        """Apply this backend's settings (its thread count) to the calling thread: a loop that runs on a
        thread of its own calls it first."""
        if self.fallback is not None:
            self.fallback.enter_thread()

    def place(self, value):
        """A host value where this backend computes (weights in their stored format)."""
        return value

    def fetch(self, value):
        """A value back on the host, as numpy."""
        return value

    def fetch_soon(self, value) -> Callable[[], object]:
        """Start bringing a value back; the function returned waits for it and gives what fetch gives."""
        return lambda: self.fetch(value)

    def zeros(self, shape: tuple[int, ...], dtype: str):
        return mapped_zeros(shape, dtype)

    def free_bytes(self) -> int | None:
        """Memory a step's activations may still take, where the backend can tell (None: the host's)."""
        return None

    def captures(self) -> Captures:
        return Captures()

    def generated(self, atoms, dtypes: tuple[str, ...], out_dtype: str):
        """A kernel compiled from an op's atom DAG (`atoms`, over inputs of `dtypes`), where this backend
        compiles formulas and the DAG is one it can write; None: the registry runs the atoms."""
        return

    def defaults(self, task: str, fmt: str, stored: str) -> Precision:
        """The precision a model runs at unless asked otherwise: as its format's reference engine runs it.
        GGUF as llama.cpp (an f16 KV cache, q8 activations into quantized matmuls); Hugging Face and soma
        directories as transformers (the cache in the checkpoint's float dtype, f32 activations)."""
        if fmt == "gguf":
            return Precision("f16", "q8")
        return Precision(stored if stored in ("f16", "bf16") else "f32", "f32")

    def prepare(self, weights: list, precision: Precision, tune: bool, force: bool = False) -> dict:
        """Ready a model's weights to run here: repacking, and with `tune` timing the kernel variants for
        shapes the dispatch table lacks (every shape when `force`). Returns what was measured."""
        return {}

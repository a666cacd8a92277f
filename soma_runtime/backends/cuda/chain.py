"""Programmatic dependent launch (Hopper and later) inside CUDA graphs: each kernel of a captured
decode step is launched while the one before it still runs, and waits inside for that one's
results. A decode step is ~200 small dependent kernels; each one's launch and ramp-up then overlaps
the tail of the one before instead of following it. Kernels launched outside a graph (a prompt's
large ones) are not chained: they lose by it (bench/results/design-notes.md).

A `chained` kernel's body starts with `after_prior()`: launched early, it must wait before it reads
anything. Without PDL (older GPUs, the interpreter) both are plain launches and no-ops."""
from __future__ import annotations

import contextlib
import inspect

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from soma_runtime.backends.cuda.device import INTERPRET

CHAINED = not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
WAIT = tl.constexpr(CHAINED)
_active = False                 # launches chain: set while a graph is warmed up and captured


@contextlib.contextmanager
def chaining():
    """Kernels launched inside are chained, where the GPU has PDL."""
    global _active
    _active = CHAINED
    try:
        yield
    finally:
        _active = False


@triton.jit
def after_prior():
    """Wait until the kernel before this one has finished and its writes are visible, then let the
    kernel after this one launch (its programs take the places this one's leave)."""
    if WAIT:
        gdc_wait()
        gdc_launch_dependents()


class chained:
    """A Triton kernel launched with PDL inside `chaining()`; `kernel[grid](...)` as ever."""

    def __init__(self, kernel):
        if "after_prior()" not in inspect.getsource(kernel.fn):
            raise TypeError(f"{kernel.fn.__name__} is launched early: it must call after_prior() first")
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **meta: launch(*args, launch_pdl=_active, **meta)

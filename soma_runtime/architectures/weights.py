"""Weights: a model's tensors by canonical name, a lookup that says which tensor is missing and where it came
from. Every architecture reads its tensors through it; the loaders give it."""
from __future__ import annotations

from soma_runtime.errors import ModelLoadError


class Weights:
    """Canonical-name tensor lookup that says which tensor is missing and where it came from."""

    def __init__(self, tensors: dict, source: str):
        self.tensors, self.source = tensors, source

    def __contains__(self, name):
        return name in self.tensors

    def __getitem__(self, name):
        if name not in self.tensors:
            raise ModelLoadError(f"{self.source}: missing tensor {name!r}")
        return self.tensors[name]

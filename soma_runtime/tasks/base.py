"""What every task's model has: Model (an id, what it was loaded from, its task and its backend), its
stand-ins for the methods of other tasks (RequestErrors naming both tasks), and the argument checks the
tasks share."""
from __future__ import annotations

import reprlib

from soma_runtime import loaders
from soma_runtime.errors import RequestError
from soma_runtime.ir.backend import Backend

# The task-specific methods of the Model classes, and the tasks whose models have each; called on a model of
# another task, one is a RequestError naming both tasks (Model's stand-ins below), never an AttributeError.
METHOD_TASKS = {"generate": ("generate",), "complete": ("generate",), "chat": ("generate",), "logits": ("generate",),
                "detokenize": ("generate",), "tokenize": ("generate", "encode"), "embed": ("encode",),
                "classify": ("encode",), "classify_tokens": ("encode",), "run": ("graph", "speak", "detect"),
                "transcribe": ("transcribe",), "speak": ("speak",), "detect": ("detect",),
                "embed_image": ("encode_image",), "classify_image": ("encode_image",)}


def check_flag(name: str, value, optional: bool = False) -> None:
    """RequestError unless `value` is true or false (or None, where `optional`)."""
    if not (isinstance(value, bool) or (optional and value is None)):
        raise RequestError(f"{name} must be true or false, got {reprlib.repr(value)}")


def check_count(name: str, value, least: int = 1, optional: bool = False) -> None:
    """RequestError unless `value` is an integer (not a bool) of at least `least` (or None, where `optional`)."""
    if not ((type(value) is int and value >= least) or (optional and value is None)):
        raise RequestError(f"{name} must be an integer >= {least}, got {reprlib.repr(value)}")


class Model:
    """What every loaded model has: an id, what it was loaded from, its task and its backend."""

    task = ""

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend):
        self.id, self.loaded, self.backend = model_id, loaded, backend

    @property
    def format(self) -> str:
        return self.loaded.format

    @property
    def path(self) -> str:
        """Where the model was loaded from (a bundled model's file, or "graph" for one built in code)."""
        return self.loaded.path

    @property
    def memory_bytes(self) -> int:
        """What the model may come to hold: its weights (and a generator's full context of KV cache)."""
        return self.weight_bytes()

    def close(self) -> None:
        """Let go of what outlives a reference to the model (processes); most models hold none."""

    def weight_bytes(self) -> int:
        return sum(int(w.nbytes) for w in self.loaded.weights.tensors.values()) if self.loaded.weights else 0

    def info(self) -> dict:
        return {"id": self.id, "task": self.task, "path": self.loaded.path, "format": self.loaded.format,
                "backend": self.backend.name, "weight_bytes": self.weight_bytes(), "memory_bytes": self.memory_bytes}

    def other_task(self, method: str) -> RequestError:
        """The error for `method` (one of METHOD_TASKS) called on this model, whose task does not have it."""
        tasks = METHOD_TASKS[method]
        return RequestError(f"{method}() is for {' or '.join(tasks)} models; model {self.id} runs the {self.task} task")


def stand_in(method: str):
    """Model's `method`, for the models of tasks without it: a RequestError naming both tasks."""
    def of_another_task(self, *args, **kwargs):
        raise self.other_task(method)
    of_another_task.__name__, of_another_task.__qualname__ = method, f"Model.{method}"
    return of_another_task


for _method in METHOD_TASKS:
    setattr(Model, _method, stand_in(_method))

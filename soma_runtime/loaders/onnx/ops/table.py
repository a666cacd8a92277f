"""The ONNX op table: (domain, op type) -> the handler that maps one node onto IR ops; and the ops whose
handlers take sequences (ops/sequence.py) among their inputs."""
from __future__ import annotations

from collections.abc import Callable

HANDLERS: dict[tuple[str, str], Callable] = {}
TAKES_SEQUENCES: set[tuple[str, str]] = set()


def onnx_op(*op_types: str, domain: str = "ai.onnx", sequences: bool = False):
    def register(fn):
        for op_type in op_types:
            HANDLERS[domain, op_type] = fn
            if sequences:
                TAKES_SEQUENCES.add((domain, op_type))
        return fn
    return register

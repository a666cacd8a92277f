"""The ONNX op table: (domain, op type) -> the handler that maps one node onto IR ops."""
from __future__ import annotations

from collections.abc import Callable

HANDLERS: dict[tuple[str, str], Callable] = {}


def onnx_op(*op_types: str, domain: str = "ai.onnx"):
    def register(fn):
        for op_type in op_types:
            HANDLERS[domain, op_type] = fn
        return fn
    return register

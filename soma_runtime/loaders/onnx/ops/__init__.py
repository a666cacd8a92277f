"""ONNX ops as IR ops: each module registers its handlers in the table (table.py).

A handler takes the converter and the node (`OnnxNode`: inputs, attributes, opset) and returns its
outputs, calling `cv.emit(ir_op, ...)` for each IR op; an opset whose semantics differ is read from
`node.opset`. Modules by kind: elementwise math, layout (shapes and indexing), nn (products,
convolutions, norms, pools), quantization, recurrent layers, resizing, detection (NonMaxSuppression),
control flow, sequences (resolved into their tensors), strings (computed at import), and onnxruntime's
contrib ops (com.microsoft).
"""
from __future__ import annotations

from soma_runtime.loaders.onnx.ops import (  # noqa: F401  (each fills the table)
    contrib,
    control,
    detection,
    elementwise,
    layout,
    nn,
    quantize,
    recurrent,
    resize,
    strings,
)
from soma_runtime.loaders.onnx.ops.sequence import Sequence  # (fills the table too)
from soma_runtime.loaders.onnx.ops.table import HANDLERS, TAKES_SEQUENCES

__all__ = ["HANDLERS", "TAKES_SEQUENCES", "Sequence"]

"""What an ultralytics export says of itself in its ONNX metadata_props: each value written as Python's str() of it
(`task` "detect", `names` "{0: 'person', ...}", `imgsz` "[640, 640]", `stride` "32", `batch` "1", `end2end`
"False", `args` "{'nms': True, ...}"), read back by ast.literal_eval (literals only, nothing run). A detect
export whose head we decode becomes a Detector: its labels, input size, stride, batch, and whether its output is
already suppressed ([B, max_det, 6] rows: NMS in the graph, or an end-to-end head) or the anchor-free head's
[B, 4 + classes, anchors]."""
from __future__ import annotations

import ast
import logging

from soma_runtime.errors import ModelLoadError
from soma_runtime.ir.graph import Graph, GraphFamily
from soma_runtime.loaders.model import Detector

log = logging.getLogger(__name__)
DEFAULT_SIZE = 640                 # ultralytics' imgsz where an export names none


def literal(props: dict[str, str], key: str, where: str, default=None):
    """The value of metadata_props[key] as the Python literal it was written as (a plain string if it is none)."""
    if key not in props:
        return default
    try:
        return ast.literal_eval(props[key])
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        if key in ("names", "imgsz", "stride", "batch", "args"):
            raise ModelLoadError(f"{where}: metadata {key!r} is not a Python literal: {props[key][:80]!r}") from None
        return props[key]


def detector_of(props: dict[str, str], graph: Graph | GraphFamily, where: str) -> Detector | None:
    """The Detector an ultralytics detect export describes; None for any other file (the `graph` task keeps it),
    or for a detect export whose output is neither layout (logged)."""
    if props.get("task") != "detect" or "names" not in props:
        return None
    names = literal(props, "names", where)
    if not (isinstance(names, dict) and all(isinstance(k, int) and isinstance(v, str) for k, v in names.items())):
        raise ModelLoadError(f"{where}: metadata 'names' must map class ids to labels, got {props['names'][:80]!r}")
    args = literal(props, "args", where, {})
    imgsz = literal(props, "imgsz", where, DEFAULT_SIZE)
    size = (imgsz, imgsz) if isinstance(imgsz, int) else tuple(imgsz)
    stride, batch = literal(props, "stride", where, 32), literal(props, "batch", where, 1)
    if not (len(size) == 2 and all(type(s) is int and s > 0 for s in (*size, stride, batch))):
        raise ModelLoadError(f"{where}: metadata imgsz {props.get('imgsz')!r}, stride {props.get('stride')!r} and batch "
                             f"{props.get('batch')!r} must be positive integers")
    outputs = list(output_metas(graph))
    if len(graph.inputs) != 1 or not outputs:
        log.info("%s: a detect export of %d inputs and %d outputs runs as a graph", where, len(graph.inputs), len(outputs))
        return None
    output, meta = outputs[0]
    suppressed = (isinstance(args, dict) and args.get("nms") is True) or literal(props, "end2end", where, False) is True
    # rows of 6 (suppressed) or 4 + classes wide (the plain head), where the file states the size
    row, expected = (None, None) if meta.ndim != 3 else (meta.shape[2], 6) if suppressed else (meta.shape[1], 4 + len(names))
    if expected is None or (isinstance(row, int) and row != expected):
        log.info("%s: a detect export with output %s is not a head we decode; it runs as a graph", where, list(meta.shape))
        return None
    return Detector(labels=dict(sorted(names.items())), input=next(iter(graph.inputs)), output=output, size=size,
                    stride=stride, batch=batch, suppressed=suppressed, head=str(props.get("head", "Detect")))


def output_metas(graph: Graph | GraphFamily):
    """(name, TensorMeta) of each output a graph (or every member of a family) gives."""
    if isinstance(graph, Graph):
        return ((name, graph.tensors[name]) for name in graph.outputs)
    return ((name, meta) for name, meta in graph.outputs.items() if meta is not None)

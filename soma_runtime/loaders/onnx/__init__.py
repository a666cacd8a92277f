"""ONNX models: the protobuf parsed by `onnx` (never run by it), converted to an IR graph of the
`graph` task. reader.py reads the file and its tensors, convert.py walks the graph, ops/ maps each
ONNX op onto IR ops, fold.py evaluates what is known at load time.

A model whose sizes depend on its inputs (an axis, a shape or a count passed as an input; a loop, an LSTM,
a resize or a squeeze over a size only the inputs' shapes settle) becomes a GraphFamily: converted again
for each distinct set of input shapes and values of its small inputs (scalars and short vectors), its
shape subgraphs evaluated on those shapes, so every size downstream is a number."""
from __future__ import annotations

import math
import os

import onnx

from soma_runtime.ir.graph import Graph, GraphFamily, TensorMeta
from soma_runtime.loaders.model import LoadedModel
from soma_runtime.loaders.onnx.convert import Converter, DataDependent, declared_shape, initializers_of
from soma_runtime.loaders.onnx.reader import dtype_name, read_model
from soma_runtime.loaders.onnx.ultralytics import detector_of
from soma_runtime.text.tokenizer import read_json

VALUE_INPUT_SIZE = 64            # inputs of at most this many numbers may be values a graph is built for


def onnx_graph(model: onnx.ModelProto, directory: str = ".", where: str = "model") -> Graph | GraphFamily:
    """An ONNX model as an IR graph (or a family of them); `directory` holds its external data, `where`
    names it in errors."""
    initializers = initializers_of(model, directory, where)
    warned: set[str] = set()                 # outputs declared with other shapes than they have, warned about once
    try:
        return Converter(model, directory, where, initializers=initializers, warned=warned).convert()
    except DataDependent as e:
        signature = {vi.name: declared(vi, where) for vi in model.graph.input if vi.name not in initializers}
        value_inputs = tuple(name for name, meta in signature.items() if is_small(meta))
        outputs = {vi.name: declared(vi, where) for vi in model.graph.output}
        undeclared = [name for name, meta in (*signature.items(), *outputs.items()) if meta is None]
        if undeclared:         # a family's signature is what its file declares
            raise DataDependent(f"{e}; converted per input shapes only where every input and output declares its "
                                f"type and rank, and {undeclared[0]!r} does not") from None

    def build(values: dict, shapes: dict) -> Graph:
        return Converter(model, directory, where, values, shapes, initializers, warned).convert()
    return GraphFamily(signature, outputs, value_inputs, build)


def declared(vi: onnx.ValueInfoProto, where: str) -> TensorMeta | None:
    shape = declared_shape(vi, where)
    if shape is None or not vi.type.HasField("tensor_type"):
        return None
    return TensorMeta(shape, dtype_name(vi.type.tensor_type.elem_type, f"{where}: {vi.name!r}"))


def is_small(meta: TensorMeta) -> bool:
    """An input that may be a parameter rather than data: a scalar or a short vector (axes, a shape, scales)."""
    return meta.ndim <= 1 and all(isinstance(d, int) for d in meta.shape) and math.prod(meta.shape) <= VALUE_INPUT_SIZE


def load_onnx(path: str) -> LoadedModel:
    """An ONNX graph; a piper voice (`voice.onnx` beside its `voice.onnx.json`) is one of the `speak` task,
    its config in metadata["voice"]; an ultralytics detect export one of the `detect` task (ultralytics.py). The
    file's metadata_props are kept as metadata["metadata_props"]."""
    model = read_model(path)
    graph = onnx_graph(model, os.path.dirname(os.path.abspath(path)), path)
    opsets = {imp.domain or "ai.onnx": int(imp.version) for imp in model.opset_import}
    metadata = {"producer": f"{model.producer_name} {model.producer_version}".strip(), "opsets": opsets,
                "onnx_ops": dict(sorted(count_ops(model.graph).items()))}
    props = {entry.key: entry.value for entry in model.metadata_props}
    if props:
        metadata["metadata_props"] = props
    voice = read_json(path + ".json") if os.path.isfile(path + ".json") else {}
    if "phoneme_id_map" in voice:
        return LoadedModel(path, "piper", None, None, None, metadata={**metadata, "voice": voice}, graph=graph)
    return LoadedModel(path, "onnx", None, None, None, metadata=metadata, graph=graph,
                       detector=detector_of(props, graph, path))


def count_ops(graph: onnx.GraphProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts

"""ONNX ops defined by a function in their schema (Attention, the losses, LpNormalization...): the node
expanded into the function's body, as ONNX defines the op, for the converter to convert node by node.

Context-dependent functions (bodies that depend on the inputs' types) are built from the types the
converter knows. Nothing here knows IR ops."""
from __future__ import annotations

import onnx
from onnx import FunctionProto, NodeProto, TypeProto, helper

from soma_runtime.ir.graph import TensorMeta
from soma_runtime.loaders.onnx.reader import ELEM_TYPES


def schema_of(op_type: str, domain: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, "" if domain == "ai.onnx" else domain)
    except onnx.defs.SchemaError:
        return None


def function_of(node: NodeProto, schema: onnx.defs.OpSchema, opset: int,
                input_metas: list[TensorMeta | None]) -> FunctionProto | None:
    """The function defining `node` at `opset` (the newest version not past it), or None."""
    plain = [v for v in schema.function_opset_versions if v <= opset]
    if plain:
        return parse(schema.get_function_with_opset_version(max(plain)))
    dependent = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
    if dependent:
        types = [type_proto(m).SerializeToString() for m in input_metas]
        body = schema.get_context_dependent_function_with_opset_version(max(dependent), node.SerializeToString(), types)
        return parse(body) if body else None
    return None


def parse(data: bytes) -> FunctionProto:
    function = FunctionProto()
    function.ParseFromString(data)
    return function


def type_proto(meta: TensorMeta | None) -> TypeProto:
    if meta is None:
        return TypeProto()
    shape = [d if isinstance(d, int) else str(d) for d in meta.shape]
    return helper.make_tensor_type_proto(ELEM_TYPES[meta.dtype], shape)


def expand(node: NodeProto, schema: onnx.defs.OpSchema, function: FunctionProto, prefix: str) -> list[NodeProto]:
    """The function's body as nodes of the caller: its formal inputs and outputs renamed to the node's
    (an absent optional one to ""), its other tensors given `prefix`, and attribute references resolved to
    the node's attributes or the schema's defaults."""
    names = {formal: (node.input[i] if i < len(node.input) else "") for i, formal in enumerate(function.input)}
    names.update({formal: node.output[i] for i, formal in enumerate(function.output)
                  if i < len(node.output) and node.output[i]})
    given = {a.name: a for a in node.attribute}
    for name, spec in schema.attributes.items():
        if name not in given and spec.default_value.name:
            given[name] = spec.default_value

    def rename(name: str) -> str:
        return names.get(name, prefix + name if name else "")

    def copy_node(inner: NodeProto) -> NodeProto:
        copy = NodeProto()
        copy.CopyFrom(inner)
        del copy.input[:], copy.output[:], copy.attribute[:]
        copy.input.extend(rename(x) for x in inner.input)
        copy.output.extend(rename(x) for x in inner.output)
        copy.name = prefix + (inner.name or inner.op_type)
        for attr in inner.attribute:
            if attr.ref_attr_name and attr.ref_attr_name not in given:
                continue
            resolved = onnx.AttributeProto()
            resolved.CopyFrom(given[attr.ref_attr_name] if attr.ref_attr_name else attr)
            resolved.name = attr.name
            if resolved.HasField("g"):
                copy_graph(resolved.g)
            copy.attribute.append(resolved)
        return copy

    def copy_graph(graph: onnx.GraphProto) -> None:
        """A branch of the body (If, Loop): its names seen from the caller too."""
        nodes = [copy_node(n) for n in graph.node]
        del graph.node[:]
        graph.node.extend(nodes)
        for value in (*graph.input, *graph.output, *graph.initializer):
            value.name = rename(value.name)

    return [copy_node(inner) for inner in function.node]

"""An ONNX graph as an IR Graph: nodes converted one by one through the op table (ops.py).

A tensor during conversion is a `Value` (the builder's handle: computed when the graph runs) or a
numpy array (known now: an initializer, a Constant, a Shape). Ops on known arrays are evaluated here
(fold.py), so shape arithmetic (Shape -> Gather -> Concat -> Reshape) becomes the static attributes
the IR's ops take; a dim the model leaves symbolic is a `Sym` inside an object array, and arithmetic
on it stays symbolic. Every failure names the file, the node, its op type and opset.

A sequence of tensors is a `Sequence`, resolved at import (ops/sequence.py). String tensors exist only as
known arrays: the IR has no string dtype, so the ops that move, select or compare strings (STRING_OPS)
are computed here on constants, and strings that would reach a graph's input or output, or an op computed
as it runs, are an UnsupportedModelError.

What one conversion may build is bounded (a hostile file must not take minutes or gigabytes to refuse):
MAX_NODES nodes converted (counted before converting, loops by the trip counts the file writes, and as
they convert); once the tensors computed now come to FOLDED_BYTES, what would pass it is left to the
graph, to be computed per run under the run's budget (ir/plan.py); a subgraph's initializers are read
once, however many steps of a loop convert it. Subgraphs nest at most ~30 deep: protobuf parses 100
messages deep.

An output's declared type must be what its nodes compute; its declared shape is a hint (as onnxruntime
takes it): where the nodes give another, theirs is the output's, and a warning says so (once for each such
output of a model, however many of its graphs are built).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from soma_runtime.errors import GraphError, ModelLoadError, UnsupportedModelError
from soma_runtime.ir.builder import GraphBuilder, Value, validate
from soma_runtime.ir.graph import Graph, Sym, TensorMeta, meta_of
from soma_runtime.ir.ops import OPS
from soma_runtime.ir.plan import meta_bytes
from soma_runtime.loaders.onnx.fold import FOLD, SymbolicError
from soma_runtime.loaders.onnx.functions import expand, function_of, schema_of
from soma_runtime.loaders.onnx.ops import HANDLERS, TAKES_SEQUENCES, Sequence
from soma_runtime.loaders.onnx.reader import dtype_name, tensor_array

OLDEST_OPSET = 1                      # every opset: a handler reads its op's older forms by the node's opset
NEWEST_OPSET = onnx.defs.onnx_opset_version()
MAX_NODES = 100_000                   # ONNX nodes converted (each unrolled step's body counted) or IR nodes built
ANY_SIZE = -1                         # a dim some exporters write for "any size" (ONNX leaves it unnamed)
FOLDED_BYTES = 64 << 20               # what one conversion computes at load time, all its tensors together
ATTRIBUTE_TYPES = {int(t): t.name for t in onnx.defs.OpSchema.AttrType.__members__.values()}
STRING = "str"                        # a string tensor's dtype while the graph converts (never the IR's)
STRING_OPS = {"reshape", "take", "gather", "concat", "slice", "split", "permute", "expand", "tile", "equal"}
Tensor = Value | np.ndarray
log = logging.getLogger("soma_runtime.onnx")


@dataclass
class OnnxNode:
    """One node as a handler sees it: its inputs (None where left out), attributes and opset."""
    name: str
    op_type: str
    opset: int
    inputs: list
    attrs: dict
    n_outputs: int

    def attr(self, key: str, default=None):
        return self.attrs.get(key, default)

    def input(self, i: int):
        return self.inputs[i] if i < len(self.inputs) else None


def symbol(name: str) -> Sym:
    """A symbolic dim named by the model (`batch`, `sequence`): made a valid name for shape arithmetic."""
    clean = re.sub(r"\W", "_", name)
    return Sym(clean if re.match(r"[A-Za-z_]", clean) else f"d_{clean}")


def declared_shape(value_info: onnx.ValueInfoProto, where: str) -> tuple | None:
    """A value's declared shape: ints, symbols for named or unnamed dims; None when it has none."""
    tensor_type = value_info.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    dims = []
    for i, d in enumerate(tensor_type.shape.dim):
        if d.HasField("dim_value") and d.dim_value != ANY_SIZE:
            if d.dim_value < 0:
                raise ModelLoadError(f"{where}: {value_info.name!r} is declared with dim {i} of {d.dim_value}")
            dims.append(int(d.dim_value))
        elif d.HasField("dim_value") or not re.search(r"[A-Za-z]", d.dim_param):
            dims.append(symbol(f"{value_info.name}_{i}"))     # `-1`, `_`, `?`, none: a size of its own
        else:
            dims.append(symbol(d.dim_param))
    return tuple(dims)


def check_nodes(graph: onnx.GraphProto, opsets: dict[str, int], where: str) -> None:
    """Before anything is converted: each node of the graph and its subgraphs (branches not taken too)
    against its op's schema, and the count of nodes the graph converts to, each Loop's body counted as many
    times as a trip count the file writes (once where it is computed); past MAX_NODES, UnsupportedModelError."""
    total, pending = 0, [(graph, 1, {})]
    while pending:
        g, times, trips = pending.pop()
        trips = {**trips, **{t.name: t for t in g.initializer}}
        for node in g.node:
            total += times
            if total > MAX_NODES:
                raise UnsupportedModelError(f"{where}: the graph has more than {MAX_NODES} nodes (loops unrolled)")
            opset = opsets.get(node.domain or "ai.onnx", 0)
            fault = schema_fault(node, schema_of(node.op_type, node.domain or "ai.onnx", opset)) if opset else None
            if fault:
                raise ModelLoadError(f"{where}: node {node.name or node.op_type!r} ({node.op_type}, opset {opset}): {fault}")
            for a in node.attribute if node.op_type == "Constant" and node.output else ():
                if a.name == "value":
                    trips[node.output[0]] = a.t
            count = trip_count(trips.get(node.input[0])) if node.op_type == "Loop" and node.input else 1
            pending.extend((sub, times * count, trips) for a in node.attribute
                           for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs))


def schema_fault(node: onnx.NodeProto, schema: onnx.defs.OpSchema | None) -> str | None:
    """What in a node's attributes, or its counts of inputs and outputs, its op's schema does not allow."""
    if schema is None:
        return None
    for a in node.attribute:
        if a.name not in schema.attributes:
            return f"attribute {a.name!r} is not one of the op's ({', '.join(schema.attributes) or 'none'})"
        if a.type != int(schema.attributes[a.name].type):
            return (f"attribute {a.name!r} is a {ATTRIBUTE_TYPES.get(a.type, a.type)}, the op takes a "
                    f"{schema.attributes[a.name].type.name}")
    for what, count, least, most in (("inputs", len(node.input), schema.min_input, schema.max_input),
                                     ("outputs", len(node.output), schema.min_output, schema.max_output)):
        if not least <= count <= most:
            return f"{count} {what}, the op takes {least}" + (f" to {most}" if most != least else "")
    return None


def trip_count(tensor: onnx.TensorProto | None) -> int:
    """A loop's trip count written in the file (an initializer, a Constant); 1 where it is not."""
    if tensor is None or tensor.data_location == onnx.TensorProto.EXTERNAL or list(tensor.dims) not in ([], [1]) or \
            tensor.data_type not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        return 1
    try:
        return max(1, int(numpy_helper.to_array(tensor).reshape(-1)[0]))
    except (ValueError, IndexError):
        return 1


def is_strings(x) -> bool:
    return isinstance(x, np.ndarray) and x.dtype.kind == "U"


def initializers_of(model: onnx.ModelProto, directory: str, path: str) -> dict[str, np.ndarray]:
    return {init.name: tensor_array(init, directory, path) for init in model.graph.initializer}


def attribute(proto: onnx.AttributeProto):
    """An attribute's value; strings as str (the protobuf holds bytes)."""
    value = helper.get_attribute_value(proto)
    return value.decode() if isinstance(value, bytes) else value


class DataDependent(UnsupportedModelError):
    """What the IR takes as a number (an axis, a shape, a count, a loop's length) depends on the inputs:
    the graph is built per input (a GraphFamily)."""


class Converter:
    """One conversion. A GraphFamily's member is converted for `values` (inputs taken as known) and
    `shapes` (the inputs' sizes); `initializers`, when given, are the model's tensors read already;
    `warned`, the outputs whose declared shapes a conversion of the same model has warned about."""

    def __init__(self, model: onnx.ModelProto, directory: str, path: str, values: dict | None = None,
                 shapes: dict | None = None, initializers: dict | None = None, warned: set | None = None):
        self.model, self.directory, self.path = model, directory, path
        self.values, self.shapes, self.initializers = values or {}, shapes or {}, initializers
        self.warned = set() if warned is None else warned
        self.builder = GraphBuilder()
        self.env: dict[str, Tensor] = {}
        self.node: OnnxNode | None = None
        self.converted, self.folded = 0, 0
        self.subgraph_tensors: dict[int, tuple[onnx.TensorProto, np.ndarray]] = {}
        self.opsets = {imp.domain or "ai.onnx": int(imp.version) for imp in model.opset_import}
        version = self.opsets.get("ai.onnx")
        if version is not None and not OLDEST_OPSET <= version <= NEWEST_OPSET:
            raise UnsupportedModelError(f"{path}: ai.onnx opset {version} is not supported "
                                        f"(opsets {OLDEST_OPSET}-{NEWEST_OPSET} are)")

    def where(self) -> str:
        n = self.node
        return f"{self.path}: node {n.name!r} ({n.op_type}, opset {n.opset})" if n else self.path

    def convert(self) -> Graph:
        graph = self.model.graph
        check_nodes(graph, self.opsets, self.path)
        if graph.sparse_initializer:
            raise UnsupportedModelError(f"{self.path}: sparse initializers are not supported")
        self.env.update(self.initializers if self.initializers is not None else
                        initializers_of(self.model, self.directory, self.path))
        for vi in graph.input:
            self.bind_input(vi)
        self.convert_nodes(graph.node)
        return self.finish([o.name for o in graph.output], {o.name: o for o in graph.output})

    def bind_input(self, vi: onnx.ValueInfoProto) -> None:
        if vi.name in self.values:
            self.env[vi.name] = self.values[vi.name]
            return
        shape = declared_shape(vi, self.path)
        if vi.name in self.env:            # an initializer listed as an input too: a default, declared alike
            value = self.env[vi.name]
            if shape is not None and (len(shape) != value.ndim or any(isinstance(d, int) and d != n
                                                                      for d, n in zip(shape, value.shape))):
                raise ModelLoadError(f"{self.path}: input {vi.name!r} is declared {list(shape)} but its initializer is "
                                     f"{list(value.shape)}")
            return
        if not vi.type.HasField("tensor_type"):
            raise UnsupportedModelError(f"{self.path}: input {vi.name!r} is not a tensor (sequences, maps and "
                                        f"optionals are not supported)")
        if shape is None:
            raise UnsupportedModelError(f"{self.path}: input {vi.name!r} declares no rank")
        shape = self.shapes.get(vi.name, shape)
        self.env[vi.name] = self.builder.input(vi.name, shape, dtype_name(vi.type.tensor_type.elem_type,
                                                                          f"{self.path}: input {vi.name!r}"))

    def convert_nodes(self, nodes) -> None:
        for proto in nodes:
            self.converted += 1
            if max(self.converted, len(self.builder.graph.nodes)) > MAX_NODES:
                raise UnsupportedModelError(f"{self.path}: the graph has more than {MAX_NODES} nodes (loops unrolled)")
            domain = proto.domain or "ai.onnx"
            self.node = OnnxNode(proto.name or proto.op_type, proto.op_type, self.opsets.get(domain, 0), [], {},
                                 len(proto.output))
            if domain not in ("ai.onnx", "ai.onnx.ml", "com.microsoft") or not self.node.opset:
                raise self.unsupported(f"op {domain}.{proto.op_type} is not supported"
                                       + ("" if self.node.opset else f" (the model imports no {domain} opset)"))
            for name in proto.input:
                if name and name not in self.env:
                    raise ModelLoadError(f"{self.where()}: input {name!r} is not produced by any node")
                if name and isinstance(self.env[name], Sequence) and (domain, proto.op_type) not in TAKES_SEQUENCES:
                    raise self.unsupported(f"input {name!r} is a sequence, which the op is not supported on")
            if (domain, proto.op_type) not in HANDLERS:
                self.convert_function(proto, domain)
                continue
            self.node.inputs = [self.env[name] if name else None for name in proto.input]
            self.node.attrs = {a.name: attribute(a) for a in proto.attribute}
            try:
                outputs = HANDLERS[domain, proto.op_type](self, self.node)
            except GraphError as e:
                raise self.unsupported(str(e)) from None
            except SymbolicError as e:
                raise DataDependent(f"{self.where()}: {e}") from None
            except (ArithmeticError, LookupError, TypeError, ValueError) as e:     # a model this converter misreads
                raise self.unsupported(f"could not be converted ({type(e).__name__}: {e})") from None
            outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
            for name, value in zip(proto.output, outputs):
                if name:
                    self.env[name] = value
            wanted = [name for name in proto.output[len(outputs):] if name]
            if wanted:
                raise self.unsupported(f"output {wanted[0]!r} is not supported")
        self.node = None

    def axis(self, value, rank: int) -> int:
        """An axis of a tensor of `rank` dims (negative: from the end); ModelLoadError past either end."""
        value = int(value)
        if not -rank <= value < rank:
            raise self.invalid(f"axis {value} is out of range for a tensor of rank {rank}")
        return value % rank

    def convert_function(self, proto: onnx.NodeProto, domain: str) -> None:
        """An op without a handler, converted as the function its schema defines it by (if any)."""
        schema = schema_of(proto.op_type, domain, self.node.opset)
        metas = [self.meta(self.env[name]) if name else None for name in proto.input]
        function = schema and function_of(proto, schema, self.node.opset, metas)
        if function is None:
            raise self.unsupported(f"op {domain}.{proto.op_type} is not supported")
        outer, node = self.opsets, self.node
        self.opsets = {**outer, **{imp.domain or "ai.onnx": int(imp.version) for imp in function.opset_import}}
        try:
            self.convert_nodes(expand(proto, schema, function, f"{node.name}/"))
        finally:
            self.opsets, self.node = outer, node
        missing = [name for name in proto.output if name and name not in self.env]
        if missing:
            raise self.unsupported(f"output {missing[0]!r} is not computed by the function defining the op")

    def finish(self, names: list[str], declared: dict) -> Graph:
        """The graph's outputs under their ONNX names, checked against the types the model declares."""
        g = self.builder.graph
        producers = g.producers()
        for name in names:
            value = self.output(name)
            if isinstance(value, Sequence):
                raise UnsupportedModelError(f"{self.path}: output {name!r} is a sequence (of {len(value.items)} tensors): "
                                            f"only tensors are supported as outputs")
            if is_strings(value):
                raise UnsupportedModelError(f"{self.path}: output {name!r} holds strings: string tensors are supported "
                                            f"only inside a graph, settled at import")
            if isinstance(value, np.ndarray) and value.dtype == object:      # Shape(x) of a symbolic x: built per shape
                raise DataDependent(f"{self.path}: output {name!r} holds sizes the model leaves symbolic "
                                    f"({', '.join(map(str, value.flat))})")
            if isinstance(value, np.ndarray):
                g.constants[name] = value
            elif value.name != name and value.name in producers and value.name not in g.outputs and name not in g.tensors:
                self.rename(value.name, name)
            elif value.name != name:
                self.builder.op("reshape", value, shape=value.shape, name=name)
                self.rename(g.nodes[-1].outputs[0], name)
            g.outputs.append(name)
            self.check_declared(name, declared.get(name))
        validate(g)
        return g

    def output(self, name: str) -> Tensor:
        if name not in self.env:
            raise ModelLoadError(f"{self.where()}: output {name!r} is not produced by any node")
        return self.env[name]

    def rename(self, old: str, new: str) -> None:
        g = self.builder.graph
        for n in g.nodes:
            n.outputs = [new if o == old else o for o in n.outputs]
            n.inputs = [new if i == old else i for i in n.inputs]
        g.tensors[new] = g.tensors.pop(old)

    def check_declared(self, name: str, vi) -> None:
        """An output's declared type must be the one its nodes compute; a declared shape they contradict is
        warned about (once per model) and theirs kept."""
        if vi is None or not vi.type.HasField("tensor_type"):
            return
        meta = self.builder.graph.tensors.get(name) or meta_of(self.builder.graph.constants[name])
        elem = vi.type.tensor_type.elem_type
        if elem and dtype_name(elem, f"{self.path}: output {name!r}") != meta.dtype:
            raise UnsupportedModelError(f"{self.path}: output {name!r} is declared {dtype_name(elem, name)}, "
                                        f"computed as {meta.dtype}")
        shape = declared_shape(vi, self.path)
        if shape is None or name in self.warned:
            return
        if len(shape) != meta.ndim or any(isinstance(d, int) and isinstance(m, int) and d != m
                                          for d, m in zip(shape, meta.shape)):
            self.warned.add(name)
            log.warning("%s: output %r is declared %s, its nodes give %s: it is given as they compute it",
                        self.path, name, list(shape), list(meta.shape))

    # --- what handlers call ---------------------------------------------------------------------

    def emit(self, op: str, *inputs: Tensor | None, **attrs) -> Tensor | tuple:
        """An IR op on these inputs: evaluated now when every input is known (and fold.py knows the op, and
        no attribute is a symbolic size), else a node of the graph (known inputs become its constants)."""
        if any(is_strings(x) for x in inputs):
            return self.fold_strings(op, inputs, attrs)
        sized = any(isinstance(d, Sym) for v in attrs.values() for d in (v if isinstance(v, (tuple, list)) else [v]))
        if all(x is None or isinstance(x, np.ndarray) for x in inputs) and op in FOLD and not sized:
            try:
                size = self.result_bytes(op, inputs, attrs)
                if self.folded + size <= FOLDED_BYTES:
                    self.folded += size
                    return FOLD[op](*inputs, **OPS[op].full_attrs(attrs))
            except (ValueError, IndexError, TypeError) as e:
                if any(x is not None and x.dtype == object for x in inputs):
                    raise SymbolicError(f"{op} of symbolic sizes ({e})") from None
                raise GraphError(f"{op} of known values: {e}") from None
        values = [None if x is None else self.value(x) for x in inputs]
        return self.builder.op(op, *values, name=self.node.name, **attrs)

    def fold_strings(self, op: str, inputs: tuple, attrs: dict):
        """An IR op on string tensors, computed now (one of STRING_OPS, on known inputs); its bytes counted
        against FOLDED_BYTES from the op's shape rule, bytes standing in for the strings."""
        if op not in STRING_OPS or not all(x is None or isinstance(x, np.ndarray) for x in inputs):
            raise self.unsupported(f"string tensors reach {op}, computed as the graph runs: strings are supported only "
                                   f"where the graph settles them at import (moved, selected or compared constants)")
        width = max(x.itemsize for x in inputs if is_strings(x))
        stand_ins = [None if x is None else TensorMeta(x.shape, "u8") if is_strings(x) else self.meta(x) for x in inputs]
        size = sum(meta_bytes(m) * width for m in OPS[op].infer(stand_ins, attrs, self.node.name))
        if self.folded + size > FOLDED_BYTES:
            raise self.unsupported(f"string tensors of {size} bytes: past the {FOLDED_BYTES} computed at import")
        self.folded += size
        return FOLD[op](*inputs, **OPS[op].full_attrs(attrs))

    def result_bytes(self, op: str, inputs: tuple, attrs: dict) -> int:
        """The bytes of an op's outputs on known inputs, before they are computed (0 where the IR's shape rule
        does not take them: numpy decides, as it folds)."""
        try:
            metas = OPS[op].infer([None if x is None else self.meta(x) for x in inputs], attrs, self.node.name)
        except GraphError:
            return 0
        own = {d.expr for m in metas for d in m.shape if isinstance(d, Sym)}      # a length the values decide
        counted = dict.fromkeys(own, OPS[op].count(*inputs, **OPS[op].full_attrs(attrs))) if own else {}
        return sum(meta_bytes(m.bind(counted)) for m in metas)

    def value(self, x: Tensor) -> Value:
        """A tensor as the graph's: a known array becomes a constant; sizes the model leaves symbolic
        (a sequence length used as data) are counted when the graph runs."""
        if isinstance(x, Value):
            return x
        if is_strings(x):
            raise self.unsupported("a string tensor given to an op computed as the graph runs (strings are supported "
                                   "only where the graph settles them at import)")
        if x.dtype != object:
            return self.builder.const(self.node.name + "/const", x)
        b, one = self.builder, self.builder.const(self.node.name + "/one", np.ones(1, np.int64))
        parts = [b.op("reduce_sum", b.op("expand", one, shape=(v,)), axes=(0,), keepdims=True) if isinstance(v, Sym)
                 else b.const(self.node.name + "/const", np.array([int(v)], np.int64)) for v in x.reshape(-1)]
        flat = parts[0] if len(parts) == 1 else b.op("concat", *parts, axis=0)
        return b.op("reshape", flat, shape=x.shape)

    def arange(self, count) -> Tensor:
        """0, 1, ... count - 1 (i64) for a count that may be a symbolic size: the running sum of that many ones."""
        if not isinstance(count, Sym):
            return np.arange(count, dtype=np.int64)
        ones = self.emit("expand", np.array([1], np.int64), shape=(count,))
        return self.emit("sub", self.emit("cumsum", ones, axis=0), np.array(1, np.int64))

    def known(self, x: Tensor | None, what: str, default=None) -> np.ndarray | None:
        """A tensor's value, needed now (a shape, axes, a count); UnsupportedModelError when only the data decides it."""
        if x is None:
            return default
        if isinstance(x, Value):
            raise DataDependent(f"{self.where()}: its {what} is computed from the data at run time (only sizes known "
                             f"at load time, or inputs of a few integers, are supported)")
        return x

    def unsupported(self, what: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.where()}: {what}")

    def invalid(self, what: str) -> ModelLoadError:
        """A node that breaks its op's definition (where unsupported() names what this converter lacks)."""
        return ModelLoadError(f"{self.where()}: {what}")

    def ints(self, x: Tensor | None, what: str, default=None, symbolic: bool = False) -> list | None:
        """A known 1-D (or scalar) integer tensor as a list of ints (and, where the caller takes them,
        symbolic dims; elsewhere a symbolic one makes the graph a family, built per input shapes)."""
        value = self.known(x, what, None)
        if value is None:
            return default
        values = [v if isinstance(v, Sym) else int(v) for v in np.asarray(value).reshape(-1)]
        if not symbolic and any(isinstance(v, Sym) for v in values):
            raise SymbolicError(f"its {what} {values} depend on the model's symbolic sizes")
        return values

    @staticmethod
    def meta(x: Tensor) -> TensorMeta:
        if isinstance(x, Value):
            return x.meta
        if x.dtype == object:
            return TensorMeta(x.shape, "i64")
        if is_strings(x):
            return TensorMeta(x.shape, STRING)
        return meta_of(x)

    def subgraph_tensor(self, tensor: onnx.TensorProto) -> np.ndarray:
        """A subgraph's initializer, read once (kept beside the protobuf wrapper whose id keys it)."""
        if id(tensor) not in self.subgraph_tensors:
            self.subgraph_tensors[id(tensor)] = tensor, tensor_array(tensor, self.directory, self.path)
        return self.subgraph_tensors[id(tensor)][1]

    def call(self, graph: onnx.GraphProto, inputs: list[Tensor] = ()) -> list[Tensor]:
        """A subgraph's outputs (a branch, one step of a loop), its nodes converted in this graph on these
        inputs: they see the outer scope's tensors, their own names stay inside."""
        if len(inputs) != len(graph.input):
            raise self.unsupported(f"its subgraph takes {len(graph.input)} inputs, given {len(inputs)}")
        outer_env, outer_node = dict(self.env), self.node
        self.env.update({vi.name: x for vi, x in zip(graph.input, inputs)})
        self.env.update({init.name: self.subgraph_tensor(init) for init in graph.initializer})
        try:
            self.convert_nodes(graph.node)
            return [self.output(o.name) for o in graph.output]
        finally:
            self.env, self.node = outer_env, outer_node

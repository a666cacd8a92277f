"""Fuzzing the ONNX path: hundreds of models mutated from five small real-shaped graphs (a conv net, a loop,
weights in external data, resizes, gathers with shape arithmetic) in their sizes, declared shapes,
attributes, external data fields, node structure, nesting and bytes, each loaded and run in a worker
whose address space is capped (fuzz_graph_worker.py). Every one must end in a typed error, or in what
onnxruntime computes, within seconds: no other exception, no run past the cap, none hung."""
from __future__ import annotations

import collections
import copy
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import onnx
import pytest
from google.protobuf.message import Error as ProtobufError
from onnx import AttributeProto, TensorProto, helper, numpy_helper

CASES = 520
WORKERS = 2                      # processes, each given its share of the cases at once
MEMORY_CAP = 2 * 2**30           # address space a worker may add on top of what it maps at start
UNCHECKED = 0.05                 # share of cases we may run where onnxruntime refuses the model: it is stricter about
                                 # parts never run (a branch not taken, node names) and cannot infer through external data
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
HOSTILE_INTS = [0, -1, 1, 2, 3, 7, 64, 10**5, 10**9, 10**12, 2**31, 2**62, 2**63 - 1, -2**63]
HOSTILE_FLOATS = [0.0, -1.0, 0.5, 3.0, 1e-9, 1e5, 1e30, float("nan"), float("inf"), float("-inf")]
INPUT_FLOATS = [0.0, -1.0, 1e-9, 1e5, 1e30, -1e30]       # no NaN or infinities: which outputs they reach is each
                                                          # runtime's interpolation formula's choice, not ONNX's
HOSTILE_STRINGS = ["", "bogus", "linear", "nearest", "cubic", "NOTSET", "VALID", "align_corners", "x" * 300]
HOSTILE_DIMS = [0, 1, 2, 5, -3, 2**31, 2**40, 2**62]
EXTERNAL_FIELDS = {"offset": ["abc", "-5", "1e3", "99999999999", "4", "0"], "length": ["0", "7", "12", "x", str(2**62)],
                   "location": ["../w.bin", "/etc/passwd", "missing.bin", "", "w.bin/..", "w.bin"]}
rng_inputs = np.random.default_rng(52)


def info(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def const(name: str, value) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def model_of(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "seed", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def conv_net():
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1], strides=[1, 1],
                              kernel_shape=[3, 3]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p"], ["f"], name="flat", axis=1),
             helper.make_node("Gemm", ["f", "fc", "fb"], ["g"], name="fc", transB=1),
             helper.make_node("Softmax", ["g"], ["y"], name="softmax", axis=-1)]
    weights = [const("w", rng_inputs.standard_normal((4, 2, 3, 3)).astype(np.float32)),
               const("b", rng_inputs.standard_normal(4).astype(np.float32)),
               const("fc", rng_inputs.standard_normal((5, 64)).astype(np.float32)),
               const("fb", rng_inputs.standard_normal(5).astype(np.float32))]
    model = model_of(nodes, [info("x", F, ["batch", 2, 8, 8])], [info("y", F, ["batch", 5])], weights)
    return model, {"x": rng_inputs.standard_normal((2, 2, 8, 8)).astype(np.float32)}, {}


def loop():
    """A Loop of `trips` steps carrying v -> v * 2 + 1 and scanning out each v."""
    body = helper.make_graph([helper.make_node("Identity", ["cond"], ["cond_out"]),
                              helper.make_node("Mul", ["v", "two"], ["doubled"]),
                              helper.make_node("Add", ["doubled", "one"], ["v_out"]),
                              helper.make_node("Identity", ["v_out"], ["scanned"])], "body",
                             [info("i", I64, []), info("cond", BOOL, []), info("v", F, [2])],
                             [info("cond_out", BOOL, []), info("v_out", F, [2]), info("scanned", F, [2])],
                             [const("two", np.full(2, 2, np.float32)), const("one", np.ones(2, np.float32))])
    nodes = [helper.make_node("Loop", ["trips", "keep", "x"], ["y", "steps"], name="loop", body=body)]
    model = model_of(nodes, [info("x", F, [2])], [info("y", F, [2]), info("steps", F, ["n", 2])],
                     [const("trips", np.int64(5)), const("keep", np.array(True))])
    return model, {"x": rng_inputs.standard_normal(2).astype(np.float32)}, {}


def external():
    """y = x @ W + b (as rows of 3), W and b in w.bin beside the model."""
    w, b = rng_inputs.standard_normal((4, 3)).astype(np.float32), rng_inputs.standard_normal(3).astype(np.float32)
    tensors = []
    for name, value, offset in (("W", w, 0), ("b", b, w.nbytes)):
        tensor = TensorProto(name=name, data_type=F, dims=value.shape, data_location=TensorProto.EXTERNAL)
        for key, field in (("location", "w.bin"), ("offset", str(offset)), ("length", str(value.nbytes))):
            tensor.external_data.add(key=key, value=field)
        tensors.append(tensor)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"], name="proj"),
             helper.make_node("Add", ["xw", "b"], ["h"], name="bias"),
             helper.make_node("Reshape", ["h", "rows"], ["y"], name="rows")]
    model = model_of(nodes, [info("x", F, ["batch", 4])], [info("y", F, None)],
                     [*tensors, const("rows", np.array([-1, 3], np.int64))])
    return model, {"x": rng_inputs.standard_normal((2, 4)).astype(np.float32)}, {"w.bin": w.tobytes() + b.tobytes()}


def resize():
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["up"], name="up", mode="linear"),
             helper.make_node("Resize", ["up", "", "", "sizes"], ["y"], name="down", mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor")]
    model = model_of(nodes, [info("x", F, [1, 1, 4, 4])], [info("y", F, None)],
                     [const("scales", np.array([1, 1, 2, 2], np.float32)), const("sizes", np.array([1, 1, 3, 5], np.int64))])
    return model, {"x": rng_inputs.standard_normal((1, 1, 4, 4)).astype(np.float32)}, {}


def gather():
    """Rows picked by index (an input: the graph is built for its values), with shape arithmetic on them."""
    nodes = [helper.make_node("Gather", ["data", "index"], ["rows"], name="pick", axis=0),
             helper.make_node("Shape", ["rows"], ["shape"], name="shape"),
             helper.make_node("ConstantOfShape", ["shape"], ["ones"], name="ones", value=const("v", np.ones(1, np.float32))),
             helper.make_node("Add", ["rows", "ones"], ["shifted"], name="shift"),
             helper.make_node("Range", ["zero", "limit", "step"], ["positions"], name="count"),
             helper.make_node("Cast", ["positions"], ["weights"], name="cast", to=F),
             helper.make_node("Expand", ["weights", "wide"], ["grid"], name="grow"),
             helper.make_node("ReduceSum", ["grid", "first"], ["column"], name="sum", keepdims=0),
             helper.make_node("Reshape", ["shifted", "flat"], ["y"], name="flatten"),
             helper.make_node("Concat", ["column", "column"], ["z"], name="join", axis=0)]
    initializers = [const("zero", np.int64(0)), const("limit", np.int64(3)), const("step", np.int64(1)),
                    const("wide", np.array([2, 3], np.int64)), const("first", np.array([0], np.int64)),
                    const("flat", np.array([-1], np.int64))]
    model = model_of(nodes, [info("data", F, [5, 3]), info("index", I64, [4])], [info("y", F, None), info("z", F, None)],
                     initializers)
    return model, {"data": rng_inputs.standard_normal((5, 3)).astype(np.float32), "index": np.array([0, 4, -1, 2])}, {}


SEEDS = [conv_net, loop, external, resize, gather]


# --- mutations: each takes (model, inputs, files, rng) and changes them in place ------------------------

def graphs_of(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """The graph and every subgraph in it."""
    found, pending = [], [graph]
    while pending:
        g = pending.pop()
        found.append(g)
        pending.extend(a.g for n in g.node for a in n.attribute if a.type == AttributeProto.GRAPH)
    return found


def values_of(tensor: TensorProto) -> np.ndarray | None:
    """An inline tensor's values; None where its dims were made to disagree with them (or are huge)."""
    if tensor.data_location == TensorProto.EXTERNAL or any(d < 0 for d in tensor.dims) or math.prod(tensor.dims) > 1 << 16:
        return None
    try:
        return numpy_helper.to_array(tensor).copy()
    except ValueError:
        return None


def mutate_size(model, inputs, files, rng):
    """An integer or float initializer (a shape, a count, a scale, a bound) given a hostile value."""
    tensors = [t for g in graphs_of(model.graph) for t in g.initializer if values_of(t) is not None]
    if not tensors:
        return
    tensor = rng.choice(tensors)
    value = values_of(tensor)
    flat = value.reshape(-1)
    if flat.size:
        hostile = rng.choice(HOSTILE_INTS if value.dtype.kind in "iu" else HOSTILE_FLOATS)
        with np.errstate(all="ignore"):
            flat[rng.randrange(flat.size)] = np.array(hostile).astype(value.dtype) if value.dtype.kind != "b" else bool(hostile)
    tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))


def mutate_shape(model, inputs, files, rng):
    """A declared shape (an input's, an output's or an initializer's dims) changed: a dim, the rank, or gone."""
    values = [*model.graph.input, *model.graph.output]
    if rng.random() < 0.3:
        tensor = rng.choice([t for t in model.graph.initializer])
        dims = list(tensor.dims) or [1]
        dims[rng.randrange(len(dims))] = rng.choice(HOSTILE_DIMS)
        del tensor.dims[:]
        tensor.dims.extend(dims)
        return
    shape = rng.choice(values).type.tensor_type.shape
    kind = rng.choice(["dim", "dim", "symbol", "add", "drop", "clear"])
    if kind in ("dim", "symbol") and shape.dim:
        dim = shape.dim[rng.randrange(len(shape.dim))]
        if kind == "dim":
            dim.dim_value = rng.choice(HOSTILE_DIMS)
        else:
            dim.dim_param = rng.choice(["n", "batch", "1x", ""])
    elif kind == "add":
        shape.dim.add().dim_value = rng.choice(HOSTILE_DIMS)
    elif kind == "drop" and shape.dim:
        del shape.dim[-1]
    else:
        shape.Clear()


def mutate_attribute(model, inputs, files, rng):
    """One attribute of one node given a hostile value, dropped, or one added that the op does not have."""
    nodes = [n for g in graphs_of(model.graph) for n in g.node]
    node = rng.choice(nodes)
    if not node.attribute or rng.random() < 0.1:
        node.attribute.append(helper.make_attribute(rng.choice(["axis", "bogus", "mode", "pads"]), rng.choice(HOSTILE_INTS)))
        return
    attr = node.attribute[rng.randrange(len(node.attribute))]
    if attr.type == AttributeProto.GRAPH or rng.random() < 0.1:
        if attr.type != AttributeProto.GRAPH:
            node.attribute.remove(attr)
        return
    if attr.type == AttributeProto.INT:
        attr.i = rng.choice(HOSTILE_INTS)
    elif attr.type == AttributeProto.INTS:
        ints = list(attr.ints) or [0]
        ints[rng.randrange(len(ints))] = rng.choice(HOSTILE_INTS)
        del attr.ints[:]
        attr.ints.extend(ints[:rng.randint(0, len(ints) + 1)] if rng.random() < 0.3 else ints)
    elif attr.type == AttributeProto.FLOAT:
        attr.f = rng.choice(HOSTILE_FLOATS)
    elif attr.type == AttributeProto.STRING:
        attr.s = rng.choice(HOSTILE_STRINGS).encode()
    elif attr.type == AttributeProto.TENSOR:
        attr.t.CopyFrom(const(attr.t.name, np.array([rng.choice(HOSTILE_FLOATS)] * rng.choice([0, 1, 2]), np.float32)))


def mutate_external(model, inputs, files, rng):
    """A field of external data rewritten, or its file swapped for a sparse one of up to 20 GB that the
    tensor claims all of."""
    tensors = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    movable = [t for t in model.graph.initializer if values_of(t) is not None]
    if not tensors and movable:                       # a seed without any: one of its initializers moved out
        tensor = rng.choice(movable)
        raw = values_of(tensor).tobytes()
        tensor.ClearField("raw_data")
        for field in ("float_data", "int64_data", "int32_data"):
            tensor.ClearField(field)
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value="moved.bin")
        files["moved.bin"] = raw
        tensors = [tensor]
    if not tensors:
        return
    tensor = rng.choice(tensors)
    if rng.random() < 0.2:
        size = rng.choice([8, 12, 20]) << 30
        files["sparse.bin"] = size
        del tensor.dims[:]
        tensor.dims.extend([size // 4])
        del tensor.external_data[:]
        tensor.external_data.add(key="location", value="sparse.bin")
        return
    key = rng.choice(list(EXTERNAL_FIELDS))
    entries = {e.key: e.value for e in tensor.external_data}
    entries[key] = rng.choice(EXTERNAL_FIELDS[key])
    del tensor.external_data[:]
    for k, v in entries.items():
        tensor.external_data.add(key=k, value=v)


def mutate_structure(model, inputs, files, rng):
    """The node list changed: a node dropped or repeated, an input repeated many times, an op swapped, an
    output renamed, or a node fed its own output."""
    graph = rng.choice(graphs_of(model.graph))
    node = graph.node[rng.randrange(len(graph.node))]
    kind = rng.choice(["drop", "repeat", "inputs", "op", "rename", "cycle"])
    if kind == "drop":
        graph.node.remove(node)
    elif kind == "repeat":
        graph.node.append(copy.deepcopy(node))
    elif kind == "inputs" and node.input:
        node.input.extend([node.input[0]] * rng.choice([1, 100, 5000]))
    elif kind == "op":
        node.op_type = rng.choice(["Concat", "Add", "Gather", "Expand", "Range", "Loop", "Tile", "Pad", "Frobnicate"])
    elif kind == "rename":
        node.output[0] = node.output[0] + "_renamed"
    else:
        node.input.append(node.output[0])


def mutate_nesting(model, inputs, files, rng):
    """The whole graph moved into If branches nested up to 40 deep (as deep as protobuf builds: ~30); the
    branches not taken pass the first input on (every seed's is a float tensor, as its outputs are)."""
    nodes, names, first = list(model.graph.node), [o.name for o in model.graph.output], model.graph.input[0].name
    for level in range(rng.choice([1, 2, 5, 20, 40])):
        inner = copy.deepcopy(list(model.graph.output))
        passed = [helper.make_tensor_value_info(f"{name}@else{level}", F, None) for name in names]
        try:
            branch = helper.make_graph(nodes, f"branch{level}", [], inner)
            other = helper.make_graph([helper.make_node("Identity", [first], [v.name]) for v in passed], f"else{level}", [],
                                      passed)
            wrapped = [helper.make_node("If", ["truth"], [f"{name}@{level + 1}" for name in names], name=f"if{level}",
                                        then_branch=branch, else_branch=other)]
            onnx.ModelProto().graph.node.extend(wrapped)
        except ProtobufError:                         # deeper than a model's protobuf holds
            break
        nodes = wrapped
        for output in model.graph.output:
            output.name = nodes[0].output[names.index(output.name.split("@")[0])]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.append(const("truth", np.array(True)))


def mutate_inputs(model, inputs, files, rng):
    """The values the model is run on made hostile: a huge or negative index, a huge or tiny number."""
    name = rng.choice(list(inputs))
    value = inputs[name].copy()
    flat = value.reshape(-1)
    flat[rng.randrange(flat.size)] = rng.choice(HOSTILE_INTS[4:] + [-5, -6] if value.dtype.kind == "i" else INPUT_FLOATS)
    inputs[name] = value


MUTATIONS = [mutate_size, mutate_size, mutate_shape, mutate_attribute, mutate_attribute, mutate_external,
             mutate_structure, mutate_nesting, mutate_inputs]


def write_case(folder, model: onnx.ModelProto, inputs: dict, files: dict, rng) -> None:
    os.makedirs(folder)
    data = model.SerializeToString()
    if rng.random() < 0.05:                           # a few cut or flipped outright
        cut = bytearray(data[:rng.randrange(1, len(data))])
        if cut and rng.random() < 0.5:
            cut[rng.randrange(len(cut))] ^= 0xFF
        data = bytes(cut)
    with open(os.path.join(folder, "model.onnx"), "wb") as f:
        f.write(data)
    for name, content in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            if isinstance(content, int):
                f.truncate(content)                   # sparse: no disk used
            else:
                f.write(content)
    np.savez(os.path.join(folder, "inputs.npz"), **inputs)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root, rng = tmp_path_factory.mktemp("onnx-fuzz"), random.Random(20261207)
    seeds = [seed() for seed in SEEDS]
    folders = []
    for i in range(CASES):
        model, inputs, files = copy.deepcopy(seeds[i % len(seeds)])
        for mutation in rng.sample(MUTATIONS, rng.choice([1, 1, 2])):
            mutation(model, inputs, files, rng)
        folder = str(root / f"case-{i}")
        write_case(folder, model, inputs, files, rng)
        folders.append(folder)
    return folders


def test_every_mutated_onnx_model_ends_in_a_typed_error_or_onnxruntimes_answer(cases):
    assert len(cases) >= 500
    shares = [cases[k::WORKERS] for k in range(WORKERS)]
    workers = [subprocess.Popen([sys.executable, "-m", "tests.hardening.fuzz_graph_worker", str(MEMORY_CAP), *share],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for share in shares]
    results = []
    for worker in workers:
        out, err = worker.communicate(timeout=600)
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert worker.returncode == 0, err[-3000:]
    assert len(results) == len(cases)
    bad = [r for r in results if r["outcome"] not in ("ModelLoadError", "RequestError", "equal", "unchecked")]
    assert not bad, bad[:10]
    outcomes = collections.Counter(r["outcome"] for r in results)
    assert {"ModelLoadError", "RequestError", "equal"} <= set(outcomes)     # the mutations reach every end
    assert outcomes["unchecked"] <= UNCHECKED * len(cases), outcomes

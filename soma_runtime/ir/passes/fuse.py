"""The fuse pass: a graph written as plain math becomes the graph the fast kernels run.

Two halves, run on any Graph before it is planned: `recognize` (recognize.py) rewrites subgraphs of
primitive ops to the fused ops whose formulas they are (an exporter's layernorm), then the rules
below rewrite patterns of ops to the fused ops' wider forms, until none applies. A tree rule is data:
a pattern (op, inputs...) whose nested ops must feed only the node above them, and what it becomes;
two rules take several nodes at once (matmuls sharing an input, the K and V appends of one layer).
Weights are rewritten where a rule needs them (stacked, interleaved) and the ones no node reads any
more are let go as soon as they are replaced; last, elementwise ops no rule took may be chained into one
node (chains.py). `fuse` returns how often each rule applied (`models info --fusions`).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.dtypes import QTensor
from soma_runtime.ir.graph import Graph, Node, meta_of
from soma_runtime.ir.ops import GATED, OPS, as_tuple
from soma_runtime.ir.passes.chains import chain_pointwise
from soma_runtime.ir.passes.dce import eliminate_dead_nodes
from soma_runtime.ir.passes.recognize import recognize
from soma_runtime.memory import release


@dataclass
class Match:
    """What a tree pattern found: each name's tensor (None: an absent input) and the nodes matched,
    the root first, then the nested ones in pattern order."""
    tensors: dict[str, str | None] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: tuple                   # (op, input patterns...): a name, "_" (anything), None (absent), or a nested pattern
    build: Callable                  # (graph, match) -> (op, inputs, attrs) of the fused node, or None to decline
    commutative: bool = False        # the root's two inputs may come in either order


class Rewriter:
    """The graph under rewriting, with each tensor's producer and readers."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.originals = set(graph.constants)          # the weights as loaded (mmapped pages, where they came from a file)
        self.index()

    def index(self) -> None:
        self.producer = {o: n for n in self.graph.nodes for o in n.outputs}
        self.readers = Counter(t for n in self.graph.nodes for t in n.inputs if t is not None)
        self.readers.update(self.graph.outputs)

    def constant(self, name: str | None):
        return None if name is None else self.graph.constants.get(name)

    def new_constant(self, name: str, value) -> str:
        self.graph.constants[name] = value
        self.graph.tensors[name] = meta_of(value)
        return name

    def node(self, op: str, inputs: list, outputs: list[str], attrs: dict, name: str) -> Node:
        """A node whose outputs' metas are known (the rules read them)."""
        metas = [None if t is None else self.graph.tensors[t] for t in inputs]
        for out, meta in zip(outputs, OPS[op].infer(metas, attrs, name)):
            self.graph.tensors[out] = meta
        return Node(op, OPS[op].pad(inputs), list(outputs), attrs, name)

    def replace(self, old: list[Node], new: list[Node]) -> None:
        """`new` where the first of `old` stood; the rest of `old` removed; constants no node reads any more
        leave at once (the weights a stacked copy replaced give their memory back before the next is made)."""
        at = next(i for i, n in enumerate(self.graph.nodes) if n is old[0])
        self.graph.nodes[at:at + 1] = new
        gone = {id(n) for n in old[1:]}
        self.graph.nodes = [n for n in self.graph.nodes if id(n) not in gone]
        self.graph.toposort()
        self.index()
        for name in {t for n in old for t in n.inputs if t in self.graph.constants}:
            if not self.readers[name]:
                self.let_go(name)

    def let_go(self, name: str) -> None:
        value = self.graph.constants.pop(name)
        if name in self.originals:                   # a file's pages: dropped from memory, read again if ever needed
            release(value.data if isinstance(value, QTensor) else np.asarray(value))

    def match(self, pattern, tensor: str | None, m: Match) -> bool:
        """Whether `tensor` is what `pattern` describes; a nested op must feed only the node above it."""
        if pattern == "_":
            return True
        if pattern is None or isinstance(pattern, str):
            if pattern is None:
                return tensor is None
            return m.tensors.setdefault(pattern, tensor) == tensor
        node = self.producer.get(tensor) if tensor is not None else None
        if node is None or node.op != pattern[0] or self.readers[tensor] != 1 or node.outputs != [tensor]:
            return False
        m.nodes.append(node)
        return self.match_inputs(pattern[1:], node.inputs, m)

    def match_inputs(self, patterns, inputs, m: Match) -> bool:
        inputs = list(inputs) + [None] * (len(patterns) - len(inputs))
        return all(self.match(p, t, m) for p, t in zip(patterns, inputs))

    def apply(self, rule: Rule, node: Node) -> bool:
        orders = [node.inputs, node.inputs[::-1]] if rule.commutative else [node.inputs]
        for inputs in orders:
            m = Match(nodes=[node])
            built = rule.build(self, m) if self.match_inputs(rule.pattern[1:], inputs, m) else None
            if built is not None:
                op, ins, attrs = built
                self.replace(m.nodes, [Node(op, OPS[op].pad(ins), list(node.outputs), attrs, node.name)])
                return True
        return False


# --- the tree rules ----------------------------------------------------------------------------------

def plain(node: Node, *absent: int) -> bool:
    """A matmul with none of its fused inputs (the given optional slots) taken yet."""
    return all(i >= len(node.inputs) or node.inputs[i] is None for i in absent)


def weight_matmul(r: Rewriter, node: Node) -> bool:
    """x @ W.T for a constant W: a linear layer, whose weight a rule may rewrite or pair with a norm."""
    return node.attrs.get("transpose_b", False) and r.constant(node.inputs[1]) is not None


def bias_into_matmul(r: Rewriter, m: Match):
    """matmul(a, W) + bias -> matmul(a, W, bias): a linear layer's bias added as the product is written."""
    mm = m.nodes[1]
    bias = r.constant(m.tensors["bias"])
    if not plain(mm, 2, 3, 4) or mm.attrs.get("epilogue", "none") != "none" or not weight_matmul(r, mm):
        return None
    if bias is None or bias.ndim != 1 or bias.shape[0] != r.constant(mm.inputs[1]).shape[0] or meta_of(bias).dtype != "f32":
        return None
    return "matmul", [mm.inputs[0], mm.inputs[1], m.tensors["bias"]], dict(mm.attrs)


def norm_into_matmul(r: Rewriter, m: Match):
    """matmul(rmsnorm(x, w), W) -> matmul(x, W, norm=w): the row's 1/rms scales the finished dots."""
    mm, norm = m.nodes
    w = r.constant(m.tensors["w"])
    if not plain(mm, 4) or not weight_matmul(r, mm) or w is None:
        return None
    inputs = (list(mm.inputs) + [None] * 5)[:5]
    inputs[0], inputs[4] = m.tensors["x"], m.tensors["w"]
    return "matmul", inputs, {**mm.attrs, "norm_eps": norm.attrs.get("eps", 1e-6)}


def residual_into_matmul(r: Rewriter, m: Match):
    """matmul(...) + r -> matmul(..., residual=r): the stream a block's output joins, added in registers."""
    mm = m.nodes[1]
    out, residual = r.graph.tensors.get(mm.outputs[0]), r.graph.tensors.get(m.tensors["r"])
    if not plain(mm, 3) or out is None or residual is None or residual.shape != out.shape or residual.dtype != out.dtype:
        return None
    ins = list(mm.inputs) + [None] * (5 - len(mm.inputs))
    ins[3] = m.tensors["r"]
    return "matmul", ins, dict(mm.attrs)


def residual_into_lora(r: Rewriter, m: Match):
    """lora_apply(...) + r -> lora_apply(..., residual=r): the stream a block's output joins, where an adapter
    op took the product's place (the matmul's own residual fold no longer sees it)."""
    lora = m.nodes[1]
    out, residual = r.graph.tensors.get(lora.outputs[0]), r.graph.tensors.get(m.tensors["r"])
    if not plain(lora, 7) or out is None or residual is None or residual.shape != out.shape or residual.dtype != out.dtype:
        return None
    ins = (list(lora.inputs) + [None] * 9)[:9]
    ins[7] = m.tensors["r"]
    return "lora_apply", ins, dict(lora.attrs)


def activation_into_matmul(r: Rewriter, m: Match):
    """gelu(matmul(...)) -> matmul(..., epilogue=gelu): applied while the product is in registers."""
    act, mm = m.nodes
    if not plain(mm, 3) or mm.attrs.get("epilogue", "none") != "none" or not weight_matmul(r, mm):
        return None
    epilogue = "gelu_tanh" if act.attrs.get("approximate") == "tanh" else "gelu"
    return "matmul", list(mm.inputs), {**mm.attrs, "epilogue": epilogue}


CONV_ACTIVATIONS = {"relu": "relu", "silu": "silu", "clip": "relu6"}     # an activation op -> the conv epilogue it is


def residual_into_conv(r: Rewriter, m: Match):
    """conv(...) + r -> conv(..., residual=r): a residual block's sum, added as the output block is finished."""
    cv = m.nodes[1]
    out, residual = r.graph.tensors.get(cv.outputs[0]), r.graph.tensors.get(m.tensors["r"])
    if not plain(cv, 3) or cv.attrs.get("epilogue", "none") != "none" or out is None or residual is None \
            or residual.shape != out.shape or residual.dtype != out.dtype:
        return None
    return cv.op, list(cv.inputs[:3]) + [m.tensors["r"]], dict(cv.attrs)


def activation_into_conv(r: Rewriter, m: Match):
    """relu / silu / clip(0, 6) of a convolution -> conv(..., epilogue=...), applied before its output leaves cache."""
    act, cv = m.nodes
    if cv.attrs.get("epilogue", "none") != "none":
        return None
    if act.op == "clip" and (act.attrs.get("min"), act.attrs.get("max")) != (0, 6):
        return None
    return cv.op, list(cv.inputs), {**cv.attrs, "epilogue": CONV_ACTIVATIONS[act.op]}


def scalar(r: Rewriter, name: str | None, value: float, rank: int) -> bool:
    """Whether `name` is a one-element constant holding `value`, of at most `rank` dims (it broadcasts away)."""
    c = r.constant(name)
    return c is not None and not isinstance(c, QTensor) and np.size(c) == 1 and np.ndim(c) <= rank \
        and float(np.asarray(c).reshape(-1)[0]) == value


def bounds_into_conv(r: Rewriter, m: Match):
    """minimum(maximum(conv(...), 0), 6) (a clip to [0, 6] as exporters write it) -> conv(..., epilogue=relu6)."""
    cv = m.nodes[2]
    rank = r.graph.tensors[cv.outputs[0]].ndim
    if cv.attrs.get("epilogue", "none") != "none" or not scalar(r, m.tensors["lo"], 0, rank) \
            or not scalar(r, m.tensors["hi"], 6, rank):
        return None
    return cv.op, list(cv.inputs), {**cv.attrs, "epilogue": "relu6"}


def pad_into_conv(r: Rewriter, m: Match):
    """conv(pad(x) by zeros, the same either side of each spatial axis) -> conv(x, padding + pad)."""
    cv, pd = m.nodes
    pads = [tuple(p) for p in pd.attrs["pads"]]
    nd = len(pads) - 2
    if pd.attrs["mode"] != "constant" or pd.attrs["value"] != 0 or pads[:2] != [(0, 0), (0, 0)] \
            or any(a != b or a < 0 for a, b in pads[2:]):
        return None
    padding = tuple(p + a for p, (a, _) in zip(as_tuple(cv.attrs["padding"], nd), pads[2:]))
    return cv.op, [m.tensors["x"]] + list(cv.inputs[1:]), {**cv.attrs, "padding": padding}


def gate_and_up(r: Rewriter, gated: Node) -> tuple[list[Node], list[str]] | None:
    """The products a gated activation joins, and their two weights' halves by name: one matmul split in
    halves (phi3's gate_up), or two matmuls of one input (gate, up) alike but for their weights."""
    if any(r.readers[t] != 1 for t in gated.inputs):
        return None
    split = r.producer.get(gated.inputs[0])
    if split is not None and split.op == "split" and gated.inputs == split.outputs:
        mm = r.producer.get(split.inputs[0])
        if split.attrs.get("axis") not in (-1, 1) or len(set(split.attrs["sizes"])) != 1 or r.readers[split.inputs[0]] != 1:
            return None
        return ([gated, split, mm], [mm.inputs[1]]) if mm is not None and mm.op == "matmul" else None
    gate, up = (r.producer.get(t) for t in gated.inputs)
    if gate is None or up is None or gate.op != "matmul" or up.op != "matmul" or gate.inputs[0] != up.inputs[0]:
        return None
    if gate.attrs != up.attrs or (gate.inputs[2] is None) != (up.inputs[2] is None) or gate.inputs[3:] != up.inputs[3:]:
        return None
    return [gated, gate, up], [gate.inputs[1], up.inputs[1]]


def gated_matmuls(r: Rewriter) -> bool:
    """act(gate) * up of a gate and an up product (or the halves of one) -> one matmul whose epilogue
    gates: the weights' rows (and biases) interleaved, gate row i then up row i, so a program holds both
    halves of its outputs; written once, never as a stacked copy first."""
    for gated in r.graph.nodes:
        epilogue = "swiglu" if gated.op == "swiglu" else "geglu_tanh" if gated.op == "geglu" and \
            gated.attrs.get("approximate") == "tanh" else None
        found = gate_and_up(r, gated) if epilogue in GATED else None
        if found is None:
            continue
        nodes, names = found
        products = nodes[1:] if len(names) == 2 else nodes[2:]
        mm = products[0]
        if not all(plain(p, 3) and p.attrs.get("epilogue", "none") == "none" and weight_matmul(r, p) for p in products):
            continue
        halves = row_halves(r.constant(names[0])) if len(names) == 1 else [r.constant(n) for n in names]
        weight = stack_rows(halves, interleave=True)
        if weight is None:
            continue
        ins = list(mm.inputs) + [None] * (5 - len(mm.inputs))
        ins[1] = r.new_constant(f"{'+'.join(names)}:interleaved", weight)
        if ins[2] is not None:
            biases = [np.asarray(r.constant(p.inputs[2]), np.float32) for p in products]
            parts = np.split(biases[0], 2) if len(biases) == 1 else biases
            ins[2] = r.new_constant(f"{'+'.join(p.inputs[2] for p in products)}:interleaved", np.stack(parts, axis=1).reshape(-1))
        r.replace(nodes, [Node("matmul", ins, list(gated.outputs), {**mm.attrs, "epilogue": epilogue}, gated.name)])
        return True
    return False


def rope_into_kv_append(r: Rewriter, m: Match):
    """kv_append(pages, rope(k), slots) -> kv_append(pages, k, slots, positions, inv_freq): keys rotated
    as they are stored."""
    append, rope = m.nodes
    ins = [m.tensors["pages"], m.tensors["k"], m.tensors["slots"], m.tensors["pos"], m.tensors["freq"], *append.inputs[5:7]]
    return "kv_append", ins, {**append.attrs, "style": rope.attrs.get("style", "neox")}


def rope_into_attention(r: Rewriter, m: Match):
    """paged_attention(rope(q), ...) -> paged_attention(q, ..., positions, inv_freq): queries rotated as
    attention loads them."""
    attn, rope = m.nodes
    ins = [m.tensors["q"], *attn.inputs[1:6]] + [None] * (6 - len(attn.inputs))
    attrs = {**attn.attrs, "rope_style": rope.attrs.get("style", "neox")}
    return "paged_attention", ins[:6] + [m.tensors["pos"], m.tensors["freq"]], attrs


TREE_RULES = [
    Rule("matmul+bias", ("add", ("matmul", "a", "W"), "bias"), bias_into_matmul, commutative=True),
    Rule("norm->matmul", ("matmul", ("rmsnorm", "x", "w"), "W"), norm_into_matmul),
    Rule("matmul->residual", ("add", ("matmul", "_", "_"), "r"), residual_into_matmul, commutative=True),
    Rule("matmul+gelu", ("gelu", ("matmul", "_", "_")), activation_into_matmul),
    Rule("lora->residual", ("add", ("lora_apply", "_", "_"), "r"), residual_into_lora, commutative=True),
    *(Rule(f"{conv}->residual", ("add", (conv, "_", "_"), "r"), residual_into_conv, commutative=True)
      for conv in ("conv1d", "conv2d")),
    *(Rule(f"{conv}+{act}", (act, (conv, "_", "_")), activation_into_conv)
      for conv in ("conv1d", "conv2d") for act in CONV_ACTIVATIONS),
    *(Rule(f"{conv}+relu6", ("minimum", ("maximum", (conv, "_", "_"), "lo"), "hi"), bounds_into_conv)
      for conv in ("conv1d", "conv2d")),
    *(Rule(f"pad->{conv}", (conv, ("pad", "x"), "_"), pad_into_conv) for conv in ("conv1d", "conv2d")),
    Rule("rope->kv_append", ("kv_append", "pages", ("rope", "k", "pos", "freq"), "slots", None, None), rope_into_kv_append),
    Rule("rope->attention", ("paged_attention", ("rope", "q", "pos", "freq"), "_", "_", "_", "_", "_", None, None),
         rope_into_attention),
]


# --- the rules over several nodes ----------------------------------------------------------------------

def stack_matmuls(r: Rewriter) -> bool:
    """Linear layers reading one input (q, k, v; gate, up) -> one product over their weights stacked by
    rows, split after: the input is read (and quantized) once. Only weights of one storage type stack."""
    groups: dict[tuple, list[Node]] = {}
    for n in r.graph.nodes:
        if n.op == "matmul" and weight_matmul(r, n) and plain(n, 3, 4) and n.attrs.get("epilogue", "none") == "none":
            with_bias = len(n.inputs) > 2 and n.inputs[2] is not None
            groups.setdefault((n.inputs[0], with_bias, repr(sorted(n.attrs.items()))), []).append(n)
    for (_, with_bias, _), nodes in groups.items():
        if len(nodes) < 2:
            continue
        weights = [r.constant(n.inputs[1]) for n in nodes]
        stacked = stack_rows(weights)
        if stacked is None:
            continue
        first = nodes[0]
        name = "+".join(n.inputs[1] for n in nodes)
        ins = [first.inputs[0], r.new_constant(name, stacked)]
        if with_bias:
            ins.append(r.new_constant("+".join(n.inputs[2] for n in nodes),
                                      np.concatenate([np.asarray(r.constant(n.inputs[2]), np.float32) for n in nodes])))
        product = f"{first.name}:stacked"
        sizes = tuple(w.shape[0] for w in weights)
        split = Node("split", [product], [n.outputs[0] for n in nodes], {"sizes": sizes, "axis": -1}, f"{first.name}:split")
        r.replace(nodes, [r.node("matmul", ins, [product], dict(first.attrs), product), split])
        return True
    return False


def pair_kv_appends(r: Rewriter) -> bool:
    """The key and value appends an attention reads (into the same slots) -> one kernel writing both."""
    for attn in r.graph.nodes:
        if attn.op != "paged_attention":
            continue
        keys, values = r.producer.get(attn.inputs[1]), r.producer.get(attn.inputs[2])
        if keys is None or values is None or {keys.op, values.op} != {"kv_append"} or keys.inputs[2] != values.inputs[2]:
            continue
        if keys.inputs[5] is not None or values.inputs[5] is not None or values.inputs[3] is not None:
            continue                                           # already paired; values are never rotated
        if keys.attrs.get("codec", "none") != values.attrs.get("codec", "none"):
            continue                                           # one kernel writes one codec
        ins = keys.inputs[:5] + [values.inputs[0], values.inputs[1]]
        r.replace([values, keys], [Node("kv_append", ins, keys.outputs + values.outputs, dict(keys.attrs), keys.name)])
        return True
    return False


def norm_into_adapted(r: Rewriter) -> bool:
    """rmsnorm(x, w) read by linear layers and the adapter ops beside them -> each takes x and norm=w: the
    norm's fold into its products (norm->matmul) where adapters read the normed rows too. After the
    products are stacked, so each product is one reader."""
    for norm in r.graph.nodes:
        if norm.op != "rmsnorm" or r.constant(norm.inputs[1] if len(norm.inputs) > 1 else None) is None:
            continue
        h = norm.outputs[0]
        readers = [n for n in r.graph.nodes if h in n.inputs]
        if h in r.graph.outputs or not any(n.op == "lora_apply" for n in readers) or not all(
                (n.op == "matmul" and n.inputs[0] == h and h not in n.inputs[1:] and plain(n, 4) and weight_matmul(r, n))
                or (n.op == "lora_apply" and n.inputs[1] == h and h not in n.inputs[:1] + n.inputs[2:] and plain(n, 8))
                for n in readers):
            continue
        eps, rewritten = norm.attrs.get("eps", 1e-6), []
        for n in readers:
            lora = n.op == "lora_apply"
            ins = (list(n.inputs) + [None] * 9)[:9 if lora else 5]
            ins[1 if lora else 0], ins[8 if lora else 4] = norm.inputs[0], norm.inputs[1]
            rewritten.append(Node(n.op, ins, list(n.outputs), {**n.attrs, "norm_eps": eps}, n.name))
        r.replace([norm, *readers], rewritten)
        return True
    return False


GROUP_RULES = [("gate/up+swiglu|geglu", gated_matmuls), ("stack matmuls", stack_matmuls), ("kv_append k+v", pair_kv_appends),
               ("norm->matmul+lora", norm_into_adapted)]


# --- weights --------------------------------------------------------------------------------------------

def stack_rows(tensors: list, interleave: bool = False):
    """Weights [N_i, K] of one storage type stacked into one [sum N_i, K] (None if types differ); with
    `interleave`, weights of equal N alternate row by row (row 0 of each, then row 1 of each, ...)."""
    join = (lambda parts: np.stack(parts, axis=1).reshape(-1, parts[0].shape[-1])) if interleave else np.concatenate
    if interleave and len({tuple(t.shape) for t in tensors}) != 1:
        return None
    if any(isinstance(t, QTensor) for t in tensors):
        if not all(isinstance(t, QTensor) for t in tensors) or len({(t.dtype.name, t.shape[1:]) for t in tensors}) != 1:
            return None
        rows = sum(t.shape[0] for t in tensors)
        return QTensor(join([t.data for t in tensors]), tensors[0].dtype, (rows, *tensors[0].shape[1:]))
    if len({(np.asarray(t).dtype, np.shape(t)[1:]) for t in tensors}) != 1:
        return None
    return join([np.asarray(t) for t in tensors])


def row_halves(t) -> list:
    """A weight's first and second halves of rows (a fused gate and up), as views."""
    half = t.shape[0] // 2
    if isinstance(t, QTensor):
        return [QTensor(t.data[rows], t.dtype, (half, *t.shape[1:])) for rows in (slice(0, half), slice(half, None))]
    return [np.asarray(t)[:half], np.asarray(t)[half:]]


# --- the pass ---------------------------------------------------------------------------------------------

def fuse(graph: Graph, recognition: bool = True, chains: bool = False) -> Counter:
    """Rewrite `graph` in place to its fused form; returns {rule: times applied}. Without `recognition`,
    only the rules run (what recognizing exporters' subgraphs buys is measured so). With `chains` (for a
    backend that compiles formulas), the elementwise ops the rules left are chained (chains.py)."""
    from soma_runtime.ir.builder import validate
    validate(graph)
    report = recognize(graph) if recognition else Counter()
    eliminate_dead_nodes(graph)                  # what recognized subgraphs replaced: a rule counts a tensor's readers
    r = Rewriter(graph)
    changed = True
    while changed:
        changed = False
        for rule in TREE_RULES:
            for node in [n for n in graph.nodes if n.op == rule.pattern[0]]:
                if node is r.producer.get(node.outputs[0]) and r.apply(rule, node):
                    report[rule.name] += 1
                    changed = True
        for name, rule in GROUP_RULES:
            while rule(r):
                report[name] += 1
                changed = True
    validate(graph)
    if chains and (made := chain_pointwise(graph)):
        report["chain"] += made
        validate(graph)
    return report

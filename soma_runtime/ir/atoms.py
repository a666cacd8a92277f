"""The 8 atoms, the atom DAG that op decompositions build, its formula hash and its interpreter.

Every op in ops.py is defined by a decomposition into these atoms; interpreting that DAG is the
reference backend: slow, obvious and right. Modes are a closed set:

  mul     mul                                   a * b (numpy broadcasting)
  add     add sub                               a + b, a - b
  cmp     max min lt le eq select               elementwise max/min, comparisons -> bool,
                                                select(cond, a, b)
  exp     exp log sqrt rsqrt recip sin cos      unary transcendental functions (round: half to
          tanh erf floor round pow              even), and pow(x, y)
  read    take take_along reshape expand        indexed lookup and views: take = index along an
          broadcast transpose permute slice     axis (embedding), take_along = torch.gather,
          cast dequant iota arange fill ranks   expand = a new axis of size 1, broadcast = to a
                                                shape, cast to a KV codec (quant/kv.py) encodes
                                                vectors as its bytes, dequant = decode quantized
                                                blocks (of a QTensor, or a codec's bytes), iota =
                                                positions 0..n-1 along an axis, arange = 0..v-1
                                                for a value v (a size known only at run time),
                                                fill = a constant tensor, ranks = the value at
                                                every rank of this process's tensor-parallel group,
                                                stacked on a new first axis
  write   place scatter                         store src into a copy of dst: place at a
                                                (strided) offset along an axis, scatter at indices
  reduce  sum max min mean prod argmax topk     collapse axes (topk: indices of the k largest)
  slide   window                                sliding windows over axes (conv, pooling)

A node's `struct` attrs (modes, target dtypes) and literals enter the formula hash (formula.py); its
`params` (axes, sizes, eps, offsets) do not: the same formula at any size or epsilon hashes the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.dtypes import DTYPES, QTensor, descending, highest, lowest
from soma_runtime.ir import collective
from soma_runtime.quant import dequantize, kv

ATOMS: dict[str, tuple[str, ...]] = {
    "mul": ("mul",),
    "add": ("add", "sub"),
    "cmp": ("max", "min", "lt", "le", "eq", "select"),
    "exp": ("exp", "log", "sqrt", "rsqrt", "recip", "sin", "cos", "tanh", "erf", "floor", "round", "pow"),
    "read": ("take", "take_along", "reshape", "expand", "broadcast", "transpose", "permute", "slice", "cast",
             "dequant", "iota", "arange", "fill", "ranks"),
    "write": ("place", "scatter"),
    "reduce": ("sum", "max", "min", "mean", "prod", "argmax", "topk"),
    "slide": ("window",),
}


@dataclass(frozen=True)
class Ref:
    """A value in an atom DAG. Inputs carry their shape and dtype; intermediates do not."""
    index: int
    shape: tuple | None = None
    dtype: str | None = None


@dataclass
class AtomNode:
    atom: str                     # an ATOMS key, or "input" / "literal" / "param" for leaves
    mode: str | int | float
    args: tuple[int, ...] = ()
    struct: tuple = ()
    params: dict = field(default_factory=dict)


class AtomGraph:
    """Builder and container for one decomposition: `A.mul(x, A.exp("rsqrt", v))`."""

    def __init__(self, input_metas):
        self.nodes: list[AtomNode] = []
        self.inputs = [None if m is None else self._leaf("input", i, m) for i, m in enumerate(input_metas)]
        self.outputs: list[int] = []

    def _leaf(self, kind, value, meta=None) -> Ref:
        self.nodes.append(AtomNode(kind, value))
        shape = None if meta is None else tuple(meta.shape)
        return Ref(len(self.nodes) - 1, shape, None if meta is None else meta.dtype)

    def _add(self, atom: str, mode: str, args, struct=(), **params) -> Ref:
        assert mode in ATOMS[atom], f"{atom} has no mode {mode}"
        self.nodes.append(AtomNode(atom, mode, tuple(a.index for a in args), tuple(struct), params))
        return Ref(len(self.nodes) - 1)

    # leaves: a literal is part of the formula (0.5 in gelu); a param is not (eps, scale)
    def lit(self, value) -> Ref:
        return self._leaf("literal", float(value))

    def param(self, value) -> Ref:
        return self._leaf("param", value)

    # the eight atoms
    def mul(self, a, b): return self._add("mul", "mul", (a, b))
    def add(self, a, b): return self._add("add", "add", (a, b))
    def sub(self, a, b): return self._add("add", "sub", (a, b))
    def cmp(self, mode, *args): return self._add("cmp", mode, args)
    def exp(self, mode, *args): return self._add("exp", mode, args)

    def read(self, mode, *args, struct=(), **params):
        if mode == "slice" and params.get("step", 1) != 1:
            struct = (*struct, "strided")     # a strided walk is another access pattern; its stride is a param
        return self._add("read", mode, args, struct, **params)

    def write(self, mode, dst, src, *index, **params):
        strided = ("strided",) if any(s != 1 for s in params.get("steps", ())) else ()
        return self._add("write", mode, (dst, src, *index), strided, **params)

    def reduce(self, mode, a, axis=-1, keepdims=True, **params):
        return self._add("reduce", mode, (a,), axis=axis, keepdims=keepdims, **params)

    def slide(self, a, **params):
        return self._add("slide", "window", (a,), **params)


# --- interpreter -------------------------------------------------------------------------------

_erf = np.vectorize(math.erf, otypes=[np.float64])
_UNARY = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "recip": lambda x: 1.0 / x, "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
    "erf": lambda x: _erf(x) if np.size(x) else np.asarray(x, np.float64), "floor": np.floor, "round": np.round,
}
_CMP = {"max": np.maximum, "min": np.minimum, "lt": np.less, "le": np.less_equal, "eq": np.equal,
        "select": np.where}
_REDUCE = {"sum": np.sum, "mean": np.mean, "prod": np.prod,
           "max": lambda x, **kw: np.max(x, initial=lowest(x.dtype), **kw),
           "min": lambda x, **kw: np.min(x, initial=highest(x.dtype), **kw)}


def _as_compute(x):
    """Reference arithmetic runs in f64 so its own rounding never hides a jet's error."""
    if isinstance(x, QTensor):
        return x
    x = np.asarray(x)
    with np.errstate(invalid="ignore"):                 # an arena's stale values (verify mode) may be anything
        return x.astype(np.float64) if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else x


def _read(mode, args, p, struct):
    x = args[0] if args else None
    if mode == "take":
        return np.take(x, args[1], axis=p["axis"])
    if mode == "take_along":
        return np.take_along_axis(x, args[1], axis=p["axis"])
    if mode == "reshape":
        return x.reshape(p["shape"])
    if mode == "expand":
        return np.expand_dims(x, p["axis"])
    if mode == "broadcast":
        return np.broadcast_to(x, p["shape"])
    if mode == "transpose":
        return np.swapaxes(x, p["axis1"], p["axis2"])
    if mode == "permute":
        return np.transpose(x, p["perm"])
    if mode == "slice":
        index = [slice(None)] * x.ndim
        index[p["axis"]] = slice(p["start"], p["stop"], p.get("step", 1))
        return x[tuple(index)]
    if mode == "cast" and struct[0] in kv.CODECS:        # encode vectors as a KV codec's bytes
        return kv.encode(struct[0], x)
    if mode == "cast":
        target = DTYPES[struct[0]].numpy
        if struct[0] in ("f16", "bf16", "f32"):      # round to the target's precision, keep computing in f64
            return x.astype(target).astype(np.float64)
        return x.astype(target)
    if mode == "dequant":
        return (kv.decode(struct[0], x) if struct else dequantize(x)).astype(np.float64)
    if mode == "iota":
        shape = [1] * p["ndim"]
        shape[p["axis"]] = p["n"]
        return np.arange(p["n"], dtype=np.int64).reshape(shape)
    if mode == "arange":
        return np.arange(max(0, int(np.ceil(x))), dtype=np.int64)
    if mode == "fill":
        return np.full(p["shape"], p["value"], dtype=np.float64)
    if mode == "ranks":
        return collective.stacked(x)
    raise AssertionError(mode)


def _write(mode, args, p):
    dst = np.array(args[0], copy=True)
    src = args[1]
    if mode == "place":
        index = [slice(None)] * dst.ndim
        for axis, start, step in zip(p["axes"], p["starts"], p["steps"]):
            index[axis % dst.ndim] = slice(start, start + step * src.shape[axis], step)
        dst[tuple(index)] = src
        return dst
    # scatter: dst[index] = src along an axis (index_copy)
    index = [slice(None)] * dst.ndim
    index[p["axis"] % dst.ndim] = np.asarray(args[2])
    dst[tuple(index)] = src
    return dst


def _reduce(mode, x, p):
    axis, keep = p["axis"], p["keepdims"]
    if mode in _REDUCE:
        return _REDUCE[mode](x, axis=axis, keepdims=keep)
    if mode == "argmax":
        return np.argmax(x, axis=axis, keepdims=keep)
    # topk: indices of the k largest along axis, largest first; ties keep the lower index
    order = np.argsort(descending(x), axis=axis, kind="stable")
    return np.take(order, np.arange(p["k"]), axis=axis)


def _slide(x, p):
    axes, window = p["axes"], p["window"]
    stride, dilation = p["stride"], p["dilation"]
    span = [(k - 1) * d + 1 for k, d in zip(window, dilation)]
    v = np.lib.stride_tricks.sliding_window_view(x, span, axis=axes)
    index = [slice(None)] * x.ndim + [slice(None, None, d) for d in dilation]
    for a, s in zip(axes, stride):
        index[a % x.ndim] = slice(None, None, s)
    return v[tuple(index)]


def interpret(graph: AtomGraph, inputs: list) -> list:
    """Run an atom DAG on numpy values; returns the output values (f64 for floats)."""
    vals: list = [None] * len(graph.nodes)
    for i, n in enumerate(graph.nodes):
        a = [vals[j] for j in n.args]
        if n.atom == "input":
            vals[i] = _as_compute(inputs[n.mode])
        elif n.atom in ("literal", "param"):
            vals[i] = n.mode
        elif n.atom == "mul":
            vals[i] = np.multiply(a[0], a[1])
        elif n.atom == "add":
            vals[i] = np.add(a[0], a[1]) if n.mode == "add" else np.subtract(a[0], a[1])
        elif n.atom == "cmp":
            vals[i] = _CMP[n.mode](*a)
        elif n.atom == "exp":
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                if n.mode == "pow":
                    vals[i] = np.power(np.asarray(a[0], np.float64), a[1])
                else:
                    vals[i] = _UNARY[n.mode](np.asarray(a[0], np.float64))
        elif n.atom == "read":
            vals[i] = _read(n.mode, a, n.params, n.struct)
        elif n.atom == "write":
            vals[i] = _write(n.mode, a, n.params)
        elif n.atom == "reduce":
            vals[i] = _reduce(n.mode, a[0], n.params)
        else:
            vals[i] = _slide(a[0], n.params)
    return [vals[o] for o in graph.outputs]

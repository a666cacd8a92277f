"""The op declaration: `OpDef` (inputs, attrs, shape/dtype rule, atom decomposition), the `OPS`
table it fills, and the shape rules and decomposition helpers the op modules share.

The decomposition is the op's meaning (the reference backend interprets it) and the source of its
formula hash. Conventions: `matmul` with `transpose_b` takes weights as [N, K] like GGUF and
nn.Linear; `rope` takes x as [..., S, H, D]; `sdpa` takes [B, H, S, D]; its `causal` mask is
aligned bottom-right (query i of Sq sees keys up to i + Sk - Sq), as a KV cache needs.
Inputs named "x?" are optional, "xs*" variadic.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from soma_runtime.dtypes import FLOATS, INTEGERS, NUMBERS, REALS, dtype
from soma_runtime.errors import GraphError
from soma_runtime.ir.atoms import AtomGraph
from soma_runtime.ir.formula import formula_hash
from soma_runtime.ir.graph import DYNAMIC, TensorMeta, dynamic_dim, same_dim


class ShapeError(Exception):
    pass


def check(cond, message):
    if not cond:
        raise ShapeError(message)


@dataclass
class OpDef:
    name: str
    inputs: tuple[str, ...]
    infer_fn: Callable
    decompose: Callable
    attrs: dict = field(default_factory=dict)
    struct: dict = field(default_factory=dict)   # attr -> representative values (formula variants)
    stateful: bool = False                       # carries state across calls (kv cache)
    view: bool = False                           # outputs alias input 0's memory ...
    aliases: tuple = ()                          # ... or output i input aliases[i]'s
    tol: float = 1.0                             # tolerance multiplier for accumulating ops
    ranks: tuple = ()                            # input ranks for tracing the formula (default 2)
    any_rank: bool = False                       # its formula depends on its input's rank: traced at ranks 1-6
    count: Callable | None = None                # a length only the data decides, from the input values and attrs,
                                                 # or its bound (before the kernel allocates it, the run's budget is
                                                 # checked against it; ValueError where they give none)
    canonical: Callable | None = None            # (metas, attrs) -> those its formula is hashed at, for an op
                                                 # whose formula's length follows a size or limit (a loop of picks)

    def aliased(self, output: int) -> int:
        """The input a view op's output aliases."""
        return self.aliases[output] if self.aliases else 0

    @property
    def variadic(self) -> bool:
        return self.inputs[-1].endswith("*")

    def pad(self, inputs: list) -> list:
        """Absent trailing optional inputs become None, so kernels see every declared input."""
        inputs = list(inputs)
        return inputs if self.variadic else inputs + [None] * (len(self.inputs) - len(inputs))

    def full_attrs(self, attrs: dict) -> dict:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise GraphError(f"op {self.name}: unknown attribute(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(self.attrs) or 'none'}")
        return {**self.attrs, **attrs}

    def infer(self, metas: list, attrs: dict, node: str = "?") -> list[TensorMeta]:
        where = f"node {node!r} ({self.name})"
        required = [i for i in self.inputs if not i.endswith(("?", "*"))]
        if len(metas) < len(required) or (not self.variadic and len(metas) > len(self.inputs)):
            raise GraphError(f"{where}: expects inputs {', '.join(self.inputs)}, got {len(metas)}")
        for spec, m in zip(self.inputs, metas):
            if m is None and not spec.endswith("?"):
                raise GraphError(f"{where}: input {spec!r} is required")
        try:
            out = self.infer_fn(metas, self.full_attrs(attrs))
        except ShapeError as e:
            raise GraphError(f"{where}: {e}") from None
        return [TensorMeta(tuple(dynamic_dim(node, i) if d == DYNAMIC else d for d in m.shape), m.dtype) for i,
                m in enumerate(out)]

    def decomposition(self, metas: list, attrs: dict) -> AtomGraph:
        A = AtomGraph(self.pad(metas))
        outs = self.decompose(A, *A.inputs, **self.full_attrs(attrs))
        A.outputs = [r.index for r in (outs if isinstance(outs, tuple) else (outs,))]
        return A

    def formula_hash(self, metas: list, attrs: dict) -> str:
        if self.canonical is not None:
            metas, attrs = self.canonical(metas, self.full_attrs(attrs))
        return formula_hash(self.decomposition(metas, attrs))


OPS: dict[str, OpDef] = {}


def op(name, inputs, infer, attrs=None, struct=None, **flags):
    def register(fn):
        OPS[name] = OpDef(name, tuple(inputs), infer, fn, dict(attrs or {}), dict(struct or {}), **flags)
        return fn
    return register


# --- shape and dtype rules -------------------------------------------------------------------

def broadcast_shapes(*shapes) -> tuple:
    nd = max(len(s) for s in shapes)
    out = []
    for dims in zip(*[(1,) * (nd - len(s)) + tuple(s) for s in shapes]):
        big = [d for d in dims if d != 1]
        for d in big[1:]:
            check(same_dim(big[0], d) is not False, f"shapes {' and '.join(map(str, map(list, shapes)))} do not broadcast")
        ints = [d for d in big if isinstance(d, int)]
        out.append(ints[0] if ints else (big[0] if big else 1))
    return tuple(out)


def float_dtype(m: TensorMeta, what="input"):
    check(m.dtype in FLOATS, f"{what} must be a float tensor (f32, f16, bf16), got {m.dtype}")
    return m.dtype


def real_dtype(m: TensorMeta, what="input"):
    check(m.dtype in REALS, f"{what} must be a float tensor (f32, f16, bf16, f64), got {m.dtype}")
    return m.dtype


def number_dtype(m: TensorMeta, what="input"):
    check(m.dtype in NUMBERS, f"{what} must be a number tensor, got {m.dtype}")
    return m.dtype


def is_integer(ref) -> bool:
    """An atom input of an integer dtype (whose arithmetic truncates rather than rounds)."""
    return ref.dtype in INTEGERS


def same_dtype(*metas):
    dts = {m.dtype for m in metas if m is not None}
    check(len(dts) == 1, f"dtype mismatch: {', '.join(sorted(dts))}")
    return dts.pop()


def like_input(metas, attrs):
    float_dtype(metas[0])
    return [metas[0]]


def elementwise(metas, attrs):
    dt = same_dtype(*metas)
    float_dtype(metas[0])
    return [TensorMeta(broadcast_shapes(*[m.shape for m in metas]), dt)]


def like_real(metas, attrs):
    real_dtype(metas[0])
    return [metas[0]]


def like_number(metas, attrs):
    number_dtype(metas[0])
    return [metas[0]]


def arithmetic(metas, attrs):
    """Elementwise arithmetic on numbers of one dtype (floats, f64 and integers)."""
    dt = same_dtype(*metas)
    number_dtype(metas[0])
    return [TensorMeta(broadcast_shapes(*[m.shape for m in metas]), dt)]


def per_channel(metas, attrs, axis):
    """Norm-style rule: optional params (weight, bias, stats) are 1-D of x's channel axis."""
    x = metas[0]
    float_dtype(x)
    for m in metas[1:]:
        if m is not None:
            check(m.ndim == 1 and same_dim(m.shape[0], x.shape[axis]) is not False,
                  f"parameter of shape {list(m.shape)} does not match channel dim {x.shape[axis]}")
    return [x]


def dim_prod(dims):
    out = 1
    for d in dims:
        out = out * d
    return out


def as_tuple(v, n):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


# --- decomposition helpers -------------------------------------------------------------------

def matmul_nk(A, a, b):
    """a[..., M, K] x b[..., N, K] -> [..., M, N] as slide-free outer product + sum over K."""
    prod = A.mul(A.read("expand", a, axis=-2), A.read("expand", b, axis=-3))
    return A.reduce("sum", prod, axis=-1, keepdims=False)


def softmax_atoms(A, x, axis):
    e = A.exp("exp", A.sub(x, A.reduce("max", x, axis=axis)))
    return A.mul(e, A.exp("recip", A.reduce("sum", e, axis=axis)))


def sigmoid_atoms(A, x):
    return A.exp("recip", A.add(A.lit(1), A.exp("exp", A.mul(x, A.lit(-1)))))


def gelu_atoms(A, x, approximate):
    if approximate == "tanh":
        inner = A.mul(A.add(x, A.mul(A.lit(0.044715), A.mul(x, A.mul(x, x)))), A.lit(math.sqrt(2 / math.pi)))
        return A.mul(A.mul(A.lit(0.5), x), A.add(A.lit(1), A.exp("tanh", inner)))
    return A.mul(A.mul(A.lit(0.5), x), A.add(A.lit(1), A.exp("erf", A.mul(x, A.lit(1 / math.sqrt(2))))))


def sign_atoms(A, v):
    return A.cmp("select", A.cmp("lt", A.lit(0), v), A.lit(1), A.cmp("select", A.cmp("lt", v, A.lit(0)), A.lit(-1), A.lit(0)))


def abs_atoms(A, v):
    return A.cmp("max", v, A.mul(v, A.lit(-1)))


def trunc_atoms(A, x):
    return A.cmp("select", A.cmp("lt", x, A.lit(0)), A.mul(A.exp("floor", A.mul(x, A.lit(-1))), A.lit(-1)),
                 A.exp("floor", x))


def truncated_division(A, a, b):
    """a / b rounded toward zero, and the remainder (of a's sign): the quotient of a * (1/b), moved by one
    where that product fell on the wrong side of an integer (exact while q * b is exact in f64)."""
    q = trunc_atoms(A, A.mul(a, A.exp("recip", b)))
    r = A.sub(a, A.mul(q, b))
    sign_a = sign_atoms(A, a)
    step = A.mul(sign_a, sign_atoms(A, b))
    short = A.cmp("le", abs_atoms(A, b), abs_atoms(A, r))
    over = A.cmp("lt", A.mul(r, sign_a), A.lit(0))
    q = A.add(q, A.cmp("select", short, step, A.cmp("select", over, A.mul(step, A.lit(-1)), A.lit(0))))
    infinite = A.cmp("eq", abs_atoms(A, b), A.lit(math.inf))          # x mod inf is x (q * b would be nan)
    return q, A.cmp("select", infinite, a, A.sub(a, A.mul(q, b)))


def attention_mask(A, scores, rows, cols, causal, window):
    """Keep key j for query i when j <= i + (cols - rows) (causal) and i + cols - rows - j < window."""
    qpos = A.add(A.read("iota", n=rows, axis=0, ndim=2), A.param(cols - rows))
    kpos = A.read("iota", n=cols, axis=1, ndim=2)
    keep = A.cmp("le", kpos, qpos) if causal else None
    if window:
        near = A.cmp("lt", A.sub(qpos, kpos), A.param(window))
        keep = near if keep is None else A.mul(keep, near)
    return A.cmp("select", keep, scores, A.lit(-math.inf))


def concat_atoms(A, parts, axis, shape, offsets):
    out = A.read("fill", shape=shape, value=0.0)
    for part, start in zip(parts, offsets):
        out = A.write("place", out, part, axes=(axis,), starts=(start,), steps=(1,))
    return out


def dequant_if_needed(A, ref):
    return A.read("dequant", ref) if dtype(ref.dtype).quantized else ref

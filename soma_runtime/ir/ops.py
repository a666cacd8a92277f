"""The closed op set. Each op is declared once: inputs, attrs, shape/dtype rule, atom decomposition.

The decomposition is the op's meaning (the reference backend interprets it) and the source of its
formula hash. Conventions: `matmul` with `transpose_b` takes weights as [N, K] like GGUF and
nn.Linear; `rope` takes x as [..., S, H, D]; `sdpa` takes [B, H, S, D]; its `causal` mask is
aligned bottom-right (query i of Sq sees keys up to i + Sk - Sq), as a KV cache needs.
Inputs named "x?" are optional, "xs*" variadic.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from soma_runtime.dtypes import FLOATS, dtype
from soma_runtime.errors import GraphError
from soma_runtime.ir.atoms import AtomGraph, Ref
from soma_runtime.ir.graph import Sym, TensorMeta, same_dim


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
            return self.infer_fn(metas, self.full_attrs(attrs))
        except ShapeError as e:
            raise GraphError(f"{where}: {e}") from None

    def decomposition(self, metas: list, attrs: dict) -> AtomGraph:
        A = AtomGraph(self.pad(metas))
        outs = self.decompose(A, *A.inputs, **self.full_attrs(attrs))
        A.outputs = [r.index for r in (outs if isinstance(outs, tuple) else (outs,))]
        return A

    def formula_hash(self, metas: list, attrs: dict) -> str:
        return self.decomposition(metas, attrs).formula_hash()


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


# --- elementwise -----------------------------------------------------------------------------

@op("add", ["a", "b"], elementwise)
def add(A, a, b): return A.add(a, b)


@op("sub", ["a", "b"], elementwise)
def sub(A, a, b): return A.sub(a, b)


@op("mul", ["a", "b"], elementwise)
def mul(A, a, b): return A.mul(a, b)


@op("div", ["a", "b"], elementwise)
def div(A, a, b): return A.mul(a, A.exp("recip", b))


@op("silu", ["x"], like_input)
def silu(A, x): return A.mul(x, sigmoid_atoms(A, x))


@op("sigmoid", ["x"], like_input)
def sigmoid(A, x): return sigmoid_atoms(A, x)


@op("tanh", ["x"], like_input)
def tanh(A, x): return A.exp("tanh", x)


@op("relu", ["x"], like_input)
def relu(A, x): return A.cmp("max", x, A.lit(0))


@op("leaky_relu", ["x"], like_input, attrs={"negative_slope": 0.01})
def leaky_relu(A, x, negative_slope):
    return A.add(A.cmp("max", x, A.lit(0)), A.mul(A.cmp("min", x, A.lit(0)), A.param(negative_slope)))


@op("gelu", ["x"], like_input, attrs={"approximate": "none"}, struct={"approximate": ("none", "tanh")})
def gelu(A, x, approximate): return gelu_atoms(A, x, approximate)


@op("swiglu", ["gate", "up"], elementwise)
def swiglu(A, gate, up): return A.mul(A.mul(gate, sigmoid_atoms(A, gate)), up)


@op("geglu", ["gate", "up"], elementwise, attrs={"approximate": "none"}, struct={"approximate": ("none", "tanh")})
def geglu(A, gate, up, approximate): return A.mul(gelu_atoms(A, gate, approximate), up)


def where_rule(metas, attrs):
    check(metas[0].dtype == "bool", f"condition must be bool, got {metas[0].dtype}")
    dt = same_dtype(metas[1], metas[2])
    return [TensorMeta(broadcast_shapes(*[m.shape for m in metas]), dt)]


@op("where", ["cond", "a", "b"], where_rule)
def where(A, cond, a, b): return A.cmp("select", cond, a, b)


def cast_rule(metas, attrs):
    target = dtype(attrs["dtype"])
    check(not target.quantized, f"cast to {target.name}: use quantize for block formats")
    return [TensorMeta(metas[0].shape, target.name)]


@op("cast", ["x"], cast_rule, attrs={"dtype": "f32"}, struct={"dtype": ("f32", "f16", "bf16", "i32", "i64")})
def cast(A, x, dtype): return A.read("cast", x, struct=(dtype,))


# --- normalization ---------------------------------------------------------------------------

@op("rmsnorm", ["x", "weight?"], lambda m, a: per_channel(m, a, -1), attrs={"eps": 1e-6})
def rmsnorm(A, x, weight, eps):
    ms = A.reduce("mean", A.mul(x, x))
    y = A.mul(x, A.exp("rsqrt", A.add(ms, A.param(eps))))
    return y if weight is None else A.mul(y, weight)


def normalize_atoms(A, x, axis, eps):
    centered = A.sub(x, A.reduce("mean", x, axis=axis))
    var = A.reduce("mean", A.mul(centered, centered), axis=axis)
    return A.mul(centered, A.exp("rsqrt", A.add(var, A.param(eps))))


def affine_atoms(A, y, weight, bias, shape):
    if weight is not None:
        y = A.mul(y, A.read("reshape", weight, shape=shape))
    if bias is not None:
        y = A.add(y, A.read("reshape", bias, shape=shape))
    return y


@op("layernorm", ["x", "weight?", "bias?"], lambda m, a: per_channel(m, a, -1), attrs={"eps": 1e-5})
def layernorm(A, x, weight, bias, eps):
    return affine_atoms(A, normalize_atoms(A, x, -1, eps), weight, bias, (-1,))


def groupnorm_rule(metas, attrs):
    x = metas[0]
    check(x.ndim >= 2, "groupnorm needs [N, C, ...]")
    if isinstance(x.shape[1], int):
        check(x.shape[1] % attrs["groups"] == 0, f"channels {x.shape[1]} not divisible by groups {attrs['groups']}")
    return per_channel(metas, attrs, 1)


def channel_shape(x):
    return (x.shape[1],) + (1,) * (len(x.shape) - 2)


@op("groupnorm", ["x", "weight?", "bias?"], groupnorm_rule, attrs={"groups": 32, "eps": 1e-5}, ranks=(4, 1, 1))
def groupnorm(A, x, weight, bias, groups, eps):
    grouped = A.read("reshape", x, shape=(x.shape[0], groups, -1))
    y = A.read("reshape", normalize_atoms(A, grouped, -1, eps), shape=x.shape)
    return affine_atoms(A, y, weight, bias, channel_shape(x))


@op("batchnorm", ["x", "mean", "var", "weight?", "bias?"], lambda m, a: per_channel(m, a, 1), attrs={"eps": 1e-5},
    ranks=(4, 1, 1, 1, 1))
def batchnorm(A, x, mean, var, weight, bias, eps):
    shape = channel_shape(x)
    centered = A.sub(x, A.read("reshape", mean, shape=shape))
    inv = A.exp("rsqrt", A.add(A.read("reshape", var, shape=shape), A.param(eps)))
    return affine_atoms(A, A.mul(centered, inv), weight, bias, shape)


def softmax_rule(metas, attrs):
    x, mask = metas[0], metas[1] if len(metas) > 1 else None
    float_dtype(x)
    if mask is not None:
        same_dtype(x, mask)
        broadcast_shapes(x.shape, mask.shape)
    check(not (attrs["causal"] or attrs["window"]) or x.ndim >= 2, "a causal softmax needs [..., Sq, Sk]")
    return [x]


@op("softmax", ["x", "mask?"], softmax_rule, attrs={"axis": -1, "causal": False, "window": 0},
    struct={"causal": (False, True), "window": (0, 4)})
def softmax(A, x, mask, axis, causal, window):
    rows, cols = x.shape[-2:] if len(x.shape) >= 2 else (1, x.shape[-1])
    if mask is not None:
        x = A.add(x, mask)
    if causal or window:
        x = attention_mask(A, x, rows, cols, causal, window)
    return softmax_atoms(A, x, axis)


# --- linear algebra and attention -----------------------------------------------------------

def matmul_rule(metas, attrs):
    a, b = metas[:2]
    bias = metas[2] if len(metas) > 2 else None
    residual = metas[3] if len(metas) > 3 else None
    norm = metas[4] if len(metas) > 4 else None
    dt = float_dtype(a, "activation")
    check(a.ndim >= 2 and b.ndim >= 2, "matmul needs rank >= 2 operands")
    check(attrs["activations"] in ("f32", "bf16", "q8"), f"activations must be f32, bf16 or q8, got {attrs['activations']!r}")
    check(attrs["epilogue"] in EPILOGUES, f"epilogue must be one of {', '.join(EPILOGUES)}, got {attrs['epilogue']!r}")
    if dtype(b.dtype).quantized:
        check(attrs["transpose_b"] and b.ndim == 2, f"a {b.dtype} weight must be 2-D [N, K] with transpose_b")
    else:
        float_dtype(b, "weight")
    n, k = (b.shape[-2], b.shape[-1]) if attrs["transpose_b"] else (b.shape[-1], b.shape[-2])
    check(same_dim(a.shape[-1], k) is not False, f"inner dims differ: {a.shape[-1]} vs {k}")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if bias is not None:
        float_dtype(bias, "bias")
        check(bias.ndim == 1 and same_dim(bias.shape[0], n) is not False, f"bias must be [{n}], got {list(bias.shape)}")
    if attrs["epilogue"] in GATED:
        check(not isinstance(n, int) or n % 2 == 0, f"a gated epilogue takes (gate, up) column pairs: {n} columns")
        n = n // 2
    out = batch + (a.shape[-2], n)
    if norm is not None:
        float_dtype(norm, "norm weight")
        check(norm.ndim == 1 and same_dim(norm.shape[0], a.shape[-1]) is not False,
              f"norm weight must be [{a.shape[-1]}], got {list(norm.shape)}")
    if residual is not None:
        float_dtype(residual, "residual")
        check(residual.ndim == len(out) and all(same_dim(r, o) is not False for r, o in zip(residual.shape, out)),
              f"residual must be {list(out)}, got {list(residual.shape)}")
    return [TensorMeta(out, dt)]


EPILOGUES = ("none", "gelu", "gelu_tanh", "swiglu", "geglu_tanh")      # what a matmul may apply to its result
GATED = ("swiglu", "geglu_tanh")      # gated activations over the result's interleaved (gate, up) column pairs


@op("matmul", ["a", "b", "bias?", "residual?", "norm?"], matmul_rule,
    attrs={"transpose_b": False, "activations": "f32", "epilogue": "none", "norm_eps": 1e-6},
    struct={"transpose_b": (False, True), "epilogue": EPILOGUES}, tol=4.0, ranks=(2, 2, 1, 2, 1))
def matmul(A, a, b, bias, residual, norm, transpose_b, activations, epilogue, norm_eps):
    """epilogue(rmsnorm(a) @ b (+ bias, a linear layer's)) (+ residual, the stream a block's output
    joins): with a `norm` weight, a is rms-normalized first (a pre-norm block's input), and a kernel
    does it all in one pass: the row's 1/rms scales the finished dot products, the epilogue and the
    residual apply while they are still in registers. A gated epilogue (swiglu, geglu_tanh) pairs
    columns 2i (gate) and 2i + 1 (up) into column i: a gated MLP's gate and up weights interleaved by
    rows, so one matrix-vector program holds both halves of its outputs. `activations="q8"` lets a kernel quantize activations per 32-block before an integer dot with
    block-quantized weights, as llama.cpp does; "bf16" lets it round them to bf16 for a bf16 weight
    (matrix units): precision hints, the formula is the same product."""
    b = dequant_if_needed(A, b)
    if not transpose_b:
        b = A.read("transpose", b, axis1=-1, axis2=-2)
    if norm is not None:
        a = rmsnorm(A, a, norm, norm_eps)
    y = matmul_nk(A, a, b)
    y = y if bias is None else A.add(y, bias)
    if epilogue in GATED:
        gate, up = (A.read("slice", y, axis=-1, start=start, stop=None, step=2) for start in (0, 1))
        y = swiglu(A, gate, up) if epilogue == "swiglu" else geglu(A, gate, up, "tanh")
    elif epilogue != "none":
        y = gelu_atoms(A, y, "tanh" if epilogue == "gelu_tanh" else "none")
    return y if residual is None else A.add(y, residual)


def sdpa_rule(metas, attrs):
    q, k, v = metas[:3]
    mask = metas[3] if len(metas) > 3 else None
    float_dtype(q)
    same_dtype(k, v)
    float_dtype(k, "k/v")
    check(q.ndim == 4 and k.ndim == 4 and v.ndim == 4, "sdpa takes q, k, v as [B, H, S, D]")
    check(attrs["precision"] in ("f32", "bf16"), f"precision must be f32 or bf16, got {attrs['precision']!r}")
    if isinstance(q.shape[1], int) and isinstance(k.shape[1], int):
        check(q.shape[1] % k.shape[1] == 0, f"query heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    check(same_dim(q.shape[3], k.shape[3]) is not False, "q and k head dims differ")
    check(same_dim(k.shape[2], v.shape[2]) is not False, "k and v lengths differ")
    out = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    if mask is not None:
        float_dtype(mask, "mask")
        broadcast_shapes(out[:3] + (k.shape[2],), mask.shape)
    return [TensorMeta(out, q.dtype)]


@op("sdpa", ["q", "k", "v", "mask?"], sdpa_rule,
    attrs={"causal": False, "scale": None, "softcap": 0.0, "window": 0, "precision": "f32"},
    struct={"causal": (False, True), "softcap": (0.0, 30.0), "window": (0, 4)}, tol=4.0, ranks=(4, 4, 4, 4))
def sdpa(A, q, k, v, mask, causal, scale, softcap, window, precision):
    """Scaled dot-product attention. With k/v in a narrower float dtype than q (an f16 KV cache),
    q and the probabilities are rounded to that dtype before their products, as llama.cpp does.
    `precision="bf16"` lets a kernel round the products' inputs to bf16 (f32 accumulation and
    softmax): a hint, like matmul's activations."""
    B, Hq, Sq, D = q.shape
    q_dtype = q.dtype
    Hkv, Sk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1 / math.sqrt(D) if isinstance(D, int) else Sym(f"1/sqrt({D})")
    if k.dtype != q.dtype:        # attention runs in the cache's precision: q is rounded to it (as llama.cpp)
        q = A.read("cast", q, struct=(k.dtype,))
    # GQA: the G query heads that share a kv head become extra query rows of that head
    grouped = A.read("reshape", q, shape=(B, Hkv, (Hq // Hkv) * Sq, D))
    scores = A.read("reshape", matmul_nk(A, grouped, k), shape=(B, Hq, Sq, Sk))
    scores = A.mul(scores, A.param(scale))
    if softcap:
        scores = A.mul(A.exp("tanh", A.mul(scores, A.param(1 / softcap))), A.param(softcap))
    if mask is not None:
        scores = A.add(scores, mask)
    if causal or window:
        scores = attention_mask(A, scores, Sq, Sk, causal, window)
    probs = A.read("reshape", softmax_atoms(A, scores, -1), shape=(B, Hkv, (Hq // Hkv) * Sq, Sk))
    if v.dtype != q_dtype:
        probs = A.read("cast", probs, struct=(v.dtype,))
    out = matmul_nk(A, probs, A.read("transpose", v, axis1=-1, axis2=-2))
    return A.read("reshape", out, shape=(B, Hq, Sq, v.shape[3]))


def rope_rule(metas, attrs):
    x, pos, inv_freq = metas
    float_dtype(x)
    check(pos.dtype in ("i32", "i64"), f"positions must be integer, got {pos.dtype}")
    check(inv_freq.ndim == 1 and inv_freq.dtype == "f32", "inv_freq must be a 1-D f32 tensor")
    check(x.ndim >= 3, "rope takes x as [..., S, H, D]")
    if isinstance(inv_freq.shape[0], int) and isinstance(x.shape[-1], int):
        check(2 * inv_freq.shape[0] <= x.shape[-1], f"rotary dims {2 * inv_freq.shape[0]} exceed head dim {x.shape[-1]}")
    broadcast_shapes(x.shape[:-2], pos.shape)
    return [x]


@op("rope", ["x", "positions", "inv_freq"], rope_rule, attrs={"style": "neox"},
    struct={"style": ("neox", "interleaved")}, ranks=(4, 2, 1))
def rope(A, x, positions, inv_freq, style):
    """Rotate the first 2*len(inv_freq) dims of each head; the rest pass through (partial rotary)."""
    half, D = inv_freq.shape[0], x.shape[-1]
    angle = A.mul(A.read("expand", A.read("cast", positions, struct=("f32",)), axis=-1), inv_freq)
    angle = A.read("expand", angle, axis=-2)                                   # [..., S, 1, R/2]
    cos, sin = A.exp("cos", angle), A.exp("sin", angle)
    if style == "neox":   # pairs (i, i + R/2)
        first = A.read("slice", x, axis=-1, start=0, stop=half)
        second = A.read("slice", x, axis=-1, start=half, stop=2 * half)
        starts, step = (0, half), 1
    else:                 # pairs (2i, 2i + 1)
        first = A.read("slice", x, axis=-1, start=0, stop=2 * half, step=2)
        second = A.read("slice", x, axis=-1, start=1, stop=2 * half, step=2)
        starts, step = (0, 1), 2
    out_first = A.sub(A.mul(first, cos), A.mul(second, sin))
    out_second = A.add(A.mul(second, cos), A.mul(first, sin))
    out = A.read("fill", shape=x.shape, value=0.0)
    out = A.write("place", out, out_first, axes=(-1,), starts=(starts[0],), steps=(step,))
    out = A.write("place", out, out_second, axes=(-1,), starts=(starts[1],), steps=(step,))
    rest = A.read("slice", x, axis=-1, start=2 * half, stop=D)
    return A.write("place", out, rest, axes=(-1,), starts=(2 * half,), steps=(1,))


def embedding_rule(metas, attrs):
    table, ids = metas
    check(table.ndim == 2, "embedding table must be [vocab, dim]")
    check(ids.dtype in ("i32", "i64"), f"token ids must be integer, got {ids.dtype}")
    dt = "f32" if dtype(table.dtype).quantized else float_dtype(table, "table")
    return [TensorMeta(tuple(ids.shape) + (table.shape[1],), dt)]


@op("embedding", ["table", "ids"], embedding_rule, ranks=(2, 1))
def embedding(A, table, ids):
    return A.read("take", dequant_if_needed(A, table), ids, axis=0)


# --- kv cache (paged: pages [P, block, H, D]; a slot is page * block + offset) --------------

def rope_inputs_rule(x, positions, inv_freq, what):
    """An op's optional rope inputs: both or neither, as the rope op takes them."""
    check((positions is None) == (inv_freq is None), f"{what}: positions and inv_freq come together")
    if positions is not None:
        rope_rule([x, positions, inv_freq], {})


def kv_append_rule(metas, attrs):
    pages, new, slots = metas[:3]
    positions, inv_freq, v_pages, v_new = list(metas[3:7]) + [None] * (7 - len(metas))
    rope_inputs_rule(new, positions, inv_freq, "kv_append")
    check(slots.dtype in ("i32", "i64"), "slots must be integer")
    check((v_pages is None) == (v_new is None), "kv_append: v_pages and v_new come together")
    check(v_pages is None or all(same_dim(a, b) is not False for a, b in zip(v_pages.shape, pages.shape)),
          "kv_append: value pages must have the key pages' shape")
    pairs = [(pages, new)] + ([(v_pages, v_new)] if v_pages is not None else [])
    for cache, rows in pairs:
        float_dtype(cache, "pages")
        float_dtype(rows)
        check(cache.ndim == 4 and rows.ndim >= 2, "kv_append takes pages [P, block, H, D] and new [..., H, D]")
        check(all(same_dim(a, b) is not False for a, b in zip(cache.shape[2:], rows.shape[-2:])), "head shape differs from the cache's")
        check(all(same_dim(a, b) is not False for a, b in zip(rows.shape[:-2], new.shape[:-2])), "values and keys differ in rows")
    return [cache for cache, _ in pairs]


@op("kv_append", ["pages", "new", "slots", "positions?", "inv_freq?", "v_pages?", "v_new?"], kv_append_rule,
    attrs={"style": "neox"}, struct={"style": ("neox", "interleaved")}, stateful=True, view=True, aliases=(0, 5),
    ranks=(4, 3, 1, 1, 1, 4, 3))
def kv_append(A, pages, new, slots, positions=None, inv_freq=None, v_pages=None, v_new=None, style="neox"):
    """Rows of `new` [..., H, D] into the cache slots; with positions and inv_freq, rotated first (rope:
    a key is stored rotated, in one pass). With v_pages and v_new, a layer's values go into the same
    slots of their own pages as well (unrotated): one kernel writes both."""
    if positions is not None and inv_freq is not None:
        new = Ref(rope(A, new, positions, inv_freq, style).index, new.shape, new.dtype)
    written = scattered(A, pages, new, slots)
    return written if v_pages is None or v_new is None else (written, scattered(A, v_pages, v_new, slots))


def scattered(A, pages, new, slots):
    """The pages with rows of `new` written into their slots, in the cache's dtype."""
    P, block, H, D = pages.shape
    flat = A.read("reshape", pages, shape=(P * block, H, D))
    rows = A.read("reshape", new, shape=(-1, H, D))
    if new.dtype != pages.dtype:          # values are stored in the cache's dtype
        rows = A.read("cast", rows, struct=(pages.dtype,))
    written = A.write("scatter", flat, rows, A.read("reshape", slots, shape=(-1,)), axis=0)
    return A.read("reshape", written, shape=pages.shape)


def kv_read_rule(metas, attrs):
    pages, slots = metas
    check(pages.ndim == 4, "kv_read takes pages [P, block, H, D]")
    check(slots.dtype in ("i32", "i64"), "slots must be integer")
    return [TensorMeta(tuple(slots.shape) + tuple(pages.shape[2:]), pages.dtype)]


@op("kv_read", ["pages", "slots"], kv_read_rule, ranks=(4, 1))
def kv_read(A, pages, slots):
    P, block, H, D = pages.shape
    return A.read("take", A.read("reshape", pages, shape=(P * block, H, D)), slots, axis=0)


def paged_attention_rule(metas, attrs):
    q, k_pages, v_pages, ctx = metas[:4]
    mask, spans, positions, inv_freq = list(metas[4:8]) + [None] * (8 - len(metas))
    rope_inputs_rule(q, positions, inv_freq, "paged_attention")
    float_dtype(q)
    check(q.ndim == 3, "paged_attention takes q as [S, H, D]")
    check(k_pages.ndim == 4 and v_pages.ndim == 4, "paged_attention takes pages as [P, block, H, D]")
    same_dtype(k_pages, v_pages)
    float_dtype(k_pages, "pages")
    check(ctx.ndim == 1 and ctx.dtype in ("i32", "i64"), "ctx_slots must be a 1-D integer tensor")
    check(same_dim(q.shape[2], k_pages.shape[3]) is not False, "q and cached k head dims differ")
    if isinstance(q.shape[1], int) and isinstance(k_pages.shape[2], int):
        check(q.shape[1] % k_pages.shape[2] == 0, f"query heads {q.shape[1]} not a multiple of kv heads {k_pages.shape[2]}")
    if mask is not None:
        float_dtype(mask, "mask")
        broadcast_shapes((1, q.shape[1], q.shape[0], ctx.shape[0]), mask.shape)
    if spans is not None:
        check(spans.dtype in ("i32", "i64"), "spans must be integer")
        check(spans.ndim == 2 and same_dim(spans.shape[0], q.shape[0]) is not False and same_dim(spans.shape[1], 2) is not False,
              f"spans must be [{q.shape[0]}, 2], got {list(spans.shape)}")
    return [TensorMeta((q.shape[0], q.shape[1], v_pages.shape[3]), q.dtype)]


@op("paged_attention", ["q", "k_pages", "v_pages", "ctx_slots", "mask?", "spans?", "positions?", "inv_freq?"],
    paged_attention_rule, attrs={"scale": None, "softcap": 0.0, "rope_style": "neox"},
    struct={"softcap": (0.0, 30.0), "rope_style": ("neox", "interleaved")}, tol=4.0, ranks=(3, 4, 4, 1, 4, 2, 1, 1))
def paged_attention(A, q, k_pages, v_pages, ctx_slots, mask, spans, positions, inv_freq, scale, softcap, rope_style):
    """New queries [S, H, D] attend over the cached keys/values at ctx_slots: kv_read, then sdpa on
    [1, H, len, D] views (mask [1, 1, S, T] additive); out [S, H, Dv]. With spans [S, 2], row s sees
    only context positions spans[s, 0] <= t < spans[s, 1] (a batch's rows, each its own sequence's
    segment), so a kernel reads nothing else. With positions and inv_freq, the queries are rotated
    first (rope, as the kernel loads them). One kernel per layer on CPU."""
    S, H, D = q.shape
    T, KV, Dv = ctx_slots.shape[0], k_pages.shape[2], v_pages.shape[3]
    if positions is not None and inv_freq is not None:
        q = Ref(rope(A, q, positions, inv_freq, rope_style).index, q.shape, q.dtype)
    if spans is not None:
        mask = span_mask(A, mask, spans, S, T)

    def heads_first(x, shape, dtype):        # [len, heads, dim] -> [1, heads, len, dim], shape known
        return Ref(A.read("expand", A.read("transpose", x, axis1=0, axis2=1), axis=0).index, shape, dtype)

    keys, values = kv_read(A, k_pages, ctx_slots), kv_read(A, v_pages, ctx_slots)
    out = sdpa(A, heads_first(q, (1, H, S, D), q.dtype), heads_first(keys, (1, KV, T, D), k_pages.dtype),
               heads_first(values, (1, KV, T, Dv), v_pages.dtype), mask, False, scale, softcap, 0, "f32")
    return A.read("transpose", A.read("reshape", out, shape=(H, S, v_pages.shape[3])), axis1=0, axis2=1)


def span_mask(A, mask, spans, S, T):
    """The additive mask with everything outside each row's span hidden: [1, 1, S, T]."""
    column = A.read("iota", n=T, axis=1, ndim=2)
    lo = A.read("slice", spans, axis=1, start=0, stop=1)
    hi = A.read("slice", spans, axis=1, start=1, stop=2)
    inside = A.mul(A.cmp("le", lo, column), A.cmp("lt", column, hi))
    hidden = A.read("reshape", A.cmp("select", inside, A.lit(0.0), A.lit(-math.inf)), shape=(1, 1, S, T))
    return hidden if mask is None else A.add(mask, hidden)


# --- layout ----------------------------------------------------------------------------------

def reshape_rule(metas, attrs):
    x, shape = metas[0], [d if isinstance(d, (int, Sym)) else Sym(d) for d in attrs["shape"]]
    check(sum(1 for d in shape if d == -1) <= 1, "at most one -1 in a reshape")
    total = dim_prod(x.shape)
    if -1 in shape:
        shape[shape.index(-1)] = inferred_dim(x.shape, [d for d in shape if d != -1], attrs["shape"])
    if isinstance(total, int) and all(isinstance(d, int) for d in shape):
        check(dim_prod(shape) == total, f"cannot reshape {list(x.shape)} to {attrs['shape']}")
    return [TensorMeta(tuple(shape), x.dtype)]


@op("reshape", ["x"], reshape_rule, attrs={"shape": ()}, view=True)
def reshape(A, x, shape): return A.read("reshape", x, shape=shape)


def inferred_dim(source, known, target):
    """The -1 of a reshape: symbols common to both sides cancel, so (B, S, 128) -> (B, S, 2, -1) gives 64."""
    syms = Counter(str(d) for d in source if isinstance(d, Sym))
    for d in known:
        if isinstance(d, Sym) and syms[str(d)]:
            syms[str(d)] -= 1
        elif isinstance(d, Sym):
            return dim_prod(source) // dim_prod(known)
    src = dim_prod([d for d in source if isinstance(d, int)])
    dst = dim_prod([d for d in known if isinstance(d, int)])
    check(dst and src % dst == 0, f"cannot reshape {list(source)} to {list(target)}")
    leftover = [Sym(name) for name, n in syms.items() for _ in range(n)]
    return dim_prod(leftover) * (src // dst) if leftover else src // dst


def permute_rule(metas, attrs):
    x, perm = metas[0], attrs["perm"]
    check(sorted(p % x.ndim for p in perm) == list(range(x.ndim)), f"{list(perm)} is not a permutation of {x.ndim} axes")
    return [TensorMeta(tuple(x.shape[p] for p in perm), x.dtype)]


@op("permute", ["x"], permute_rule, attrs={"perm": ()}, view=True)
def permute(A, x, perm): return A.read("permute", x, perm=perm)


def transpose_rule(metas, attrs):
    x = metas[0]
    shape = list(x.shape)
    a, b = attrs["dim0"] % x.ndim, attrs["dim1"] % x.ndim
    shape[a], shape[b] = shape[b], shape[a]
    return [TensorMeta(tuple(shape), x.dtype)]


@op("transpose", ["x"], transpose_rule, attrs={"dim0": -2, "dim1": -1}, view=True)
def transpose(A, x, dim0, dim1): return A.read("transpose", x, axis1=dim0, axis2=dim1)


def slice_length(n, start, stop, step):
    if isinstance(n, int):
        return len(range(*slice(start, stop, step).indices(n)))
    if start < 0 and stop is None and step == 1:     # a tail of a symbolic length, e.g. the last token
        return -start
    stop = n if stop is None else stop
    return (stop - start + step - 1) // step


def slice_rule(metas, attrs):
    x = metas[0]
    axis = attrs["axis"] % x.ndim
    check(attrs["step"] > 0, "slice step must be positive")
    shape = list(x.shape)
    shape[axis] = slice_length(shape[axis], attrs["start"], attrs["stop"], attrs["step"])
    return [TensorMeta(tuple(shape), x.dtype)]


@op("slice", ["x"], slice_rule, attrs={"axis": 0, "start": 0, "stop": None, "step": 1}, struct={"step": (1, 2)}, view=True)
def slice_(A, x, axis, start, stop, step):
    return A.read("slice", x, axis=axis, start=start, stop=stop, step=step)


def concat_rule(metas, attrs):
    dt = same_dtype(*metas)
    first = metas[0]
    axis = attrs["axis"] % first.ndim
    for m in metas[1:]:
        check(m.ndim == first.ndim and all(same_dim(a, b) is not False for i, (a, b) in enumerate(zip(m.shape, first.shape)) if i != axis),
              f"concat inputs {[list(m.shape) for m in metas]} differ off axis {attrs['axis']}")
    shape = list(first.shape)
    shape[axis] = sum_dims([m.shape[axis] for m in metas])
    return [TensorMeta(tuple(shape), dt)]


def sum_dims(dims):
    total = 0
    for d in dims:
        total = total + d
    return total


@op("concat", ["xs*"], concat_rule, attrs={"axis": 0})
def concat(A, *xs, axis):
    shape = list(xs[0].shape)
    lengths = [x.shape[axis] for x in xs]
    shape[axis] = sum_dims(lengths)
    offsets = [sum_dims(lengths[:i]) for i in range(len(xs))]
    return concat_atoms(A, xs, axis, tuple(shape), offsets)


def split_rule(metas, attrs):
    x = metas[0]
    axis = attrs["axis"] % x.ndim
    if isinstance(x.shape[axis], int):
        check(sum(attrs["sizes"]) == x.shape[axis], f"split sizes {list(attrs['sizes'])} do not sum to {x.shape[axis]}")
    return [TensorMeta(tuple(s if i != axis else n for i, s in enumerate(x.shape)), x.dtype) for n in attrs["sizes"]]


@op("split", ["x"], split_rule, attrs={"sizes": (), "axis": 0},
    struct={"sizes": tuple((1,) * n for n in range(1, 17))}, view=True)
def split(A, x, sizes, axis):
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(A.read("slice", x, axis=axis, start=s, stop=s + n) for s, n in zip(starts, sizes))


def gather_rule(metas, attrs):
    x, index = metas
    check(index.dtype in ("i32", "i64"), "index must be integer")
    check(index.ndim == x.ndim, "gather index must have the rank of x")
    return [TensorMeta(index.shape, x.dtype)]


@op("gather", ["x", "index"], gather_rule, attrs={"axis": 0})
def gather(A, x, index, axis): return A.read("take_along", x, index, axis=axis)


def argmax_rule(metas, attrs):
    x = metas[0]
    axis = attrs["axis"] % x.ndim
    return [TensorMeta(tuple(d for i, d in enumerate(x.shape) if i != axis), "i64")]


@op("argmax", ["x"], argmax_rule, attrs={"axis": -1})
def argmax(A, x, axis): return A.reduce("argmax", x, axis=axis, keepdims=False)


def topk_rule(metas, attrs):
    x = metas[0]
    axis = attrs["axis"] % x.ndim
    if isinstance(x.shape[axis], int):
        check(0 < attrs["k"] <= x.shape[axis], f"k={attrs['k']} out of range for size {x.shape[axis]}")
    shape = tuple(attrs["k"] if i == axis else d for i, d in enumerate(x.shape))
    return [TensorMeta(shape, x.dtype), TensorMeta(shape, "i64")]


@op("topk", ["x"], topk_rule, attrs={"k": 1, "axis": -1})
def topk(A, x, k, axis):
    index = A.reduce("topk", x, axis=axis, k=k)
    return A.read("take_along", x, index, axis=axis), index


def sample_rule(metas, attrs):
    logits, params = metas
    float_dtype(logits, "logits")
    check(logits.ndim == 2, f"sample takes logits [rows, vocab], got {list(logits.shape)}")
    check(params.dtype == "f32" and params.ndim == 2 and same_dim(params.shape[0], logits.shape[0]) is not False
          and same_dim(params.shape[1], 5) is not False, f"params must be f32 [{logits.shape[0]}, 5], got {params.dtype} {list(params.shape)}")
    if isinstance(logits.shape[1], int):
        check(1 <= attrs["width"] <= logits.shape[1], f"width={attrs['width']} out of range for a vocabulary of {logits.shape[1]}")
    return [TensorMeta((logits.shape[0],), "i64")]


@op("sample", ["logits", "params"], sample_rule, attrs={"width": 64})
def sample(A, logits, params, width):
    """Each row's token from its params row (temperature, top_k, top_p, min_p, u). Temperature 0 takes
    the most likely. Otherwise, over the `width` most likely tokens (top_k outside [1, width] counts as
    width): logits / temperature -> top-k (ties at the k-th kept) -> top-p (the most likely first,
    until their probability reaches top_p) -> min-p (probability >= min_p x the top one's) -> the draw:
    the first survivor, in token order, whose share of the cumulative probability exceeds u."""
    ids = A.reduce("topk", logits, axis=-1, k=width)                      # [R, W], most likely first
    v = A.read("take_along", logits, ids, axis=-1)
    t, k, top_p, min_p, u = (A.read("slice", params, axis=1, start=i, stop=i + 1) for i in range(5))
    rank = A.read("iota", n=width, axis=1, ndim=2)
    greedy = A.cmp("eq", t, A.lit(0.0))
    x = A.mul(v, A.exp("recip", A.cmp("select", greedy, A.lit(1.0), t)))
    kth = A.reduce("max", A.cmp("select", A.cmp("eq", rank, A.sub(k, A.lit(1.0))), v, A.lit(-math.inf)), axis=1)
    live = A.cmp("le", kth, v)
    e = A.cmp("select", live, A.exp("exp", A.sub(x, A.reduce("max", x, axis=1))), A.lit(0.0))
    prob = A.mul(e, A.exp("recip", A.reduce("sum", e, axis=1)))

    def pairwise_sum(w, pairs):             # out[r, j] = sum over i of w[r, i] * pairs[r, i, j]
        return A.reduce("sum", A.mul(A.read("expand", w, axis=2), pairs), axis=1, keepdims=False)

    before = pairwise_sum(prob, A.cmp("lt", A.read("iota", n=width, axis=1, ndim=3), A.read("iota", n=width, axis=2, ndim=3)))
    nucleus = A.cmp("max", A.cmp("lt", before, top_p), A.cmp("le", A.lit(1.0), top_p))
    keep = A.mul(A.mul(live, nucleus), A.cmp("le", min_p, e))
    w = A.cmp("select", keep, e, A.lit(0.0))
    cdf = pairwise_sum(w, A.cmp("le", A.read("expand", ids, axis=2), A.read("expand", ids, axis=1)))
    hit = A.mul(keep, A.cmp("lt", u, A.mul(cdf, A.exp("recip", A.reduce("sum", w, axis=1)))))
    drawn = A.reduce("min", A.cmp("select", hit, ids, A.lit(math.inf)), axis=1)
    chosen = A.cmp("select", greedy, A.read("slice", ids, axis=1, start=0, stop=1), drawn)
    return A.read("cast", A.read("reshape", chosen, shape=(-1,)), struct=("i64",))


# --- convolution, pooling, resampling ------------------------------------------------------

def conv_out(n, k, stride, pad, dil):
    return (n + 2 * pad - dil * (k - 1) - 1) // stride + 1


def conv_rule(nd):
    def rule(metas, attrs):
        x, w, b = metas[0], metas[1], metas[2] if len(metas) > 2 else None
        dt = same_dtype(x, w, b)
        float_dtype(x)
        check(x.ndim == nd + 2 and w.ndim == nd + 2, f"conv{nd}d takes x [N, C, *{nd} dims] and w [O, C/groups, *{nd} kernel]")
        g = attrs["groups"]
        if isinstance(x.shape[1], int) and isinstance(w.shape[1], int):
            check(x.shape[1] == w.shape[1] * g, f"input channels {x.shape[1]} != {w.shape[1]} x groups {g}")
        if isinstance(w.shape[0], int):
            check(w.shape[0] % g == 0, f"output channels {w.shape[0]} not divisible by groups {g}")
        if b is not None:
            check(b.ndim == 1, "conv bias must be 1-D")
        st, pd, dl = (as_tuple(attrs[k], nd) for k in ("stride", "padding", "dilation"))
        spatial = tuple(conv_out(n, k, s, p, d) for n, k, s, p, d in zip(x.shape[2:], w.shape[2:], st, pd, dl))
        check(all(not isinstance(s, int) or s > 0 for s in spatial), "kernel larger than padded input")
        return [TensorMeta((x.shape[0], w.shape[0]) + spatial, dt)]
    return rule


def pad_atoms(A, x, pads, value):
    nd = len(pads)
    shape = tuple(x.shape[:-nd]) + tuple(n + 2 * p for n, p in zip(x.shape[-nd:], pads))
    dst = A.read("fill", shape=shape, value=value)
    return A.write("place", dst, x, axes=tuple(range(-nd, 0)), starts=tuple(pads), steps=(1,) * nd)


def conv_atoms(A, x, w, b, stride, padding, dilation, groups, nd):
    N, C = x.shape[:2]
    O, kernel = w.shape[0], tuple(w.shape[2:])
    st, pd, dl = as_tuple(stride, nd), as_tuple(padding, nd), as_tuple(dilation, nd)
    spatial = tuple(conv_out(n, k, s, p, d) for n, k, s, p, d in zip(x.shape[2:], kernel, st, pd, dl))
    windows = A.slide(pad_atoms(A, x, pd, 0.0), axes=tuple(range(2, 2 + nd)), window=kernel, stride=st, dilation=dl)
    xg = A.read("reshape", windows, shape=(N, groups, 1, C // groups) + spatial + kernel)
    wg = A.read("reshape", w, shape=(1, groups, O // groups, C // groups) + (1,) * nd + kernel)
    summed_axes = (3,) + tuple(range(4 + nd, 4 + 2 * nd))
    y = A.read("reshape", A.reduce("sum", A.mul(xg, wg), axis=summed_axes, keepdims=False), shape=(N, O) + spatial)
    return y if b is None else A.add(y, A.read("reshape", b, shape=(O,) + (1,) * nd))


CONV_ATTRS = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}


@op("conv1d", ["x", "weight", "bias?"], conv_rule(1), attrs=CONV_ATTRS, tol=4.0, ranks=(3, 3, 1))
def conv1d(A, x, weight, bias, **attrs): return conv_atoms(A, x, weight, bias, nd=1, **attrs)


@op("conv2d", ["x", "weight", "bias?"], conv_rule(2), attrs=CONV_ATTRS, tol=4.0, ranks=(4, 4, 1))
def conv2d(A, x, weight, bias, **attrs): return conv_atoms(A, x, weight, bias, nd=2, **attrs)


def pool_rule(metas, attrs):
    x = metas[0]
    float_dtype(x)
    k = attrs["kernel"]
    nd = len(k)
    check(nd in (1, 2, 3) and x.ndim == nd + 2, f"pooling with a {nd}-D kernel takes x [N, C, *{nd} dims]")
    st = as_tuple(attrs["stride"] or k, nd)
    pd = as_tuple(attrs["padding"], nd)
    check(all(p * 2 <= kk for p, kk in zip(pd, k)), "padding must be at most half the kernel")
    spatial = tuple(conv_out(n, kk, s, p, 1) for n, kk, s, p in zip(x.shape[2:], k, st, pd))
    return [TensorMeta(tuple(x.shape[:2]) + spatial, x.dtype)]


def pool_atoms(A, x, kernel, stride, padding, mode, pad_value):
    nd = len(kernel)
    st, pd = as_tuple(stride or kernel, nd), as_tuple(padding, nd)
    windows = A.slide(pad_atoms(A, x, pd, pad_value), axes=tuple(range(2, 2 + nd)), window=tuple(kernel),
                      stride=st, dilation=(1,) * nd)
    return A.reduce(mode, windows, axis=tuple(range(-nd, 0)), keepdims=False)


POOL_ATTRS = {"kernel": (2, 2), "stride": None, "padding": 0}


@op("max_pool", ["x"], pool_rule, attrs=POOL_ATTRS, ranks=(4,))
def max_pool(A, x, **attrs): return pool_atoms(A, x, mode="max", pad_value=-math.inf, **attrs)


@op("avg_pool", ["x"], pool_rule, attrs=POOL_ATTRS, ranks=(4,))
def avg_pool(A, x, **attrs): return pool_atoms(A, x, mode="mean", pad_value=0.0, **attrs)


def interpolate_rule(metas, attrs):
    x = metas[0]
    float_dtype(x)
    size = tuple(attrs["size"])
    check(len(size) in (1, 2) and x.ndim == len(size) + 2, "interpolate takes x [N, C, *spatial] and size per spatial dim")
    check(attrs["mode"] in ("nearest", "bilinear"), f"mode must be nearest or bilinear, got {attrs['mode']}")
    return [TensorMeta(tuple(x.shape[:2]) + size, x.dtype)]


def source_scale(n_in, n_out, align_corners):
    if align_corners:
        return (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    return n_in / n_out


def resample_axis(A, x, axis, n_in, n_out, mode, align_corners):
    """Resample one axis: nearest takes floor(dst * in/out); bilinear blends two neighbours."""
    dst = A.read("cast", A.read("iota", n=n_out, axis=0, ndim=1), struct=("f32",))
    scale = A.param(source_scale(n_in, n_out, align_corners) if isinstance(n_in, int) else Sym(f"{n_in}/{n_out}"))
    last = A.param(n_in - 1)
    if mode == "nearest":
        index = A.cmp("min", A.exp("floor", A.mul(dst, scale)), last)
        return A.read("take", x, A.read("cast", index, struct=("i64",)), axis=axis)
    if align_corners:
        src = A.mul(dst, scale)
    else:
        src = A.cmp("max", A.sub(A.mul(A.add(dst, A.lit(0.5)), scale), A.lit(0.5)), A.lit(0))
    lower = A.exp("floor", src)
    frac = A.sub(src, lower)
    i0 = A.read("cast", lower, struct=("i64",))
    i1 = A.read("cast", A.cmp("min", A.add(lower, A.lit(1)), last), struct=("i64",))
    trailing = (n_out,) + (1,) * (-1 - axis)
    w1 = A.read("reshape", frac, shape=trailing)
    w0 = A.read("reshape", A.sub(A.lit(1), frac), shape=trailing)
    return A.add(A.mul(A.read("take", x, i0, axis=axis), w0), A.mul(A.read("take", x, i1, axis=axis), w1))


@op("interpolate", ["x"], interpolate_rule, attrs={"size": (1, 1), "mode": "nearest", "align_corners": False},
    struct={"mode": ("nearest", "bilinear"), "align_corners": (False, True)}, ranks=(4,))
def interpolate(A, x, size, mode, align_corners):
    nd = len(size)
    for i, n_out in enumerate(size):
        axis = i - nd
        x = resample_axis(A, x, axis, A.inputs[0].shape[axis], n_out, mode, align_corners)
    return x

"""Elementwise arithmetic, activations, gated activations, selection and casts."""
from __future__ import annotations

from soma_runtime.dtypes import DTYPES, dtype
from soma_runtime.ir.graph import TensorMeta
from soma_runtime.ir.ops.base import (
    arithmetic,
    broadcast_shapes,
    check,
    elementwise,
    gelu_atoms,
    is_integer,
    like_input,
    op,
    same_dtype,
    sigmoid_atoms,
    sign_atoms,
    truncated_division,
)


@op("add", ["a", "b"], arithmetic)
def add(A, a, b): return A.add(a, b)


@op("sub", ["a", "b"], arithmetic)
def sub(A, a, b): return A.sub(a, b)


@op("mul", ["a", "b"], arithmetic)
def mul(A, a, b): return A.mul(a, b)


@op("div", ["a", "b"], arithmetic)
def div(A, a, b):
    """Integers divide rounding toward zero (as C, ONNX and torch's trunc mode do)."""
    return truncated_division(A, a, b)[0] if is_integer(a) else A.mul(a, A.exp("recip", b))


@op("mod", ["a", "b"], arithmetic, attrs={"fmod": False}, struct={"fmod": (False, True)})
def mod(A, a, b, fmod):
    """The remainder of a / b: of a's sign with `fmod` (C's fmod), else of b's (Python's %)."""
    r = truncated_division(A, a, b)[1]
    if fmod:
        return r
    return A.add(r, A.cmp("select", A.cmp("lt", A.mul(r, sign_atoms(A, b)), A.lit(0)), b, A.lit(0)))


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


PLAIN = tuple(name for name, d in DTYPES.items() if not d.quantized)


def cast_rule(metas, attrs):
    target = dtype(attrs["dtype"])
    check(not target.quantized, f"cast to {target.name}: use quantize for block formats")
    return [TensorMeta(metas[0].shape, target.name)]


@op("cast", ["x"], cast_rule, attrs={"dtype": "f32"}, struct={"dtype": PLAIN})
def cast(A, x, dtype): return A.read("cast", x, struct=(dtype,))

"""Elementwise ONNX ops: arithmetic, comparisons, logic, activations, casts."""
from __future__ import annotations

import functools
import math

import numpy as np
from onnx import TensorProto

from soma_runtime.dtypes import dtype
from soma_runtime.loaders.onnx.ops.table import onnx_op
from soma_runtime.loaders.onnx.reader import dtype_name

BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "Equal": "equal", "Less": "less",
          "LessOrEqual": "less_equal", "Greater": "greater", "GreaterOrEqual": "greater_equal", "And": "logical_and",
          "Or": "logical_or"}
UNARY = {"Abs": "abs", "Neg": "neg", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Reciprocal": "reciprocal", "Sin": "sin",
         "Cos": "cos", "Tanh": "tanh", "Sigmoid": "sigmoid", "Relu": "relu", "Erf": "erf", "Floor": "floor", "Ceil": "ceil",
         "Round": "round", "Not": "logical_not", "Atan": "atan"}
VARIADIC = {"Max": "maximum", "Min": "minimum", "Sum": "add", "Mean": "add"}


def scalar(cv, value, like) -> np.ndarray:
    """A constant of `like`'s dtype (a 0-d array: it broadcasts against anything)."""
    return np.array(value, dtype(cv.meta(like).dtype).numpy)


def cast_to(cv, x, like):
    """x in `like`'s dtype (unchanged where it already is)."""
    target = cv.meta(like).dtype
    return x if cv.meta(x).dtype == target else cv.emit("cast", x, dtype=target)


def in_f32(handler):
    """A composite activation on half inputs: computed in f32 and rounded once, as the op is defined
    (rounding each step to f16/bf16 drifts by an ulp)."""
    @functools.wraps(handler)
    def run(cv, n):
        half = cv.meta(n.inputs[0]).dtype
        if half not in ("f16", "bf16"):
            return handler(cv, n)
        n.inputs = [x if x is None or cv.meta(x).dtype != half else cv.emit("cast", x, dtype="f32") for x in n.inputs]
        return cv.emit("cast", handler(cv, n), dtype=half)
    return run


def legacy_broadcast(cv, n, a, b):
    """b as it broadcasts against a. Before opset 7 only where the `broadcast` attribute says so, with b's dims
    lined up against a's from `axis` (by default, a's last dims); without it both shapes must be equal."""
    if n.opset >= 7:
        return b
    rank, dims = cv.meta(a).ndim, cv.meta(b).shape
    if not n.attr("broadcast", 0):
        if cv.meta(a).shape != dims:
            raise cv.invalid(f"shapes {list(cv.meta(a).shape)} and {list(dims)} differ and `broadcast` is not set")
        return b
    axis = rank - len(dims) if n.attr("axis") is None else cv.axis(n.attr("axis"), rank)
    if axis + len(dims) > rank:
        raise cv.invalid(f"{list(dims)} does not fit {list(cv.meta(a).shape)} from axis {axis}")
    return cv.emit("reshape", b, shape=(*dims, *[1] * (rank - axis - len(dims))))


@onnx_op(*BINARY)
def binary(cv, n):
    a, b = n.inputs[:2]
    b = legacy_broadcast(cv, n, a, b)
    if n.op_type == "Pow":
        b = cast_to(cv, b, a)                     # the exponent may be of another type than the base
    return cv.emit(BINARY[n.op_type], a, b)


@onnx_op("Mod")
def mod(cv, n):
    return cv.emit("mod", *n.inputs, fmod=bool(n.attr("fmod", 0)))


@onnx_op("IsNaN")
def is_nan(cv, n):
    x = n.inputs[0]
    return cv.emit("logical_not", cv.emit("equal", x, x))


@onnx_op("IsInf")
def is_inf(cv, n):
    x = n.inputs[0]
    signs = [s for s, on in ((1, n.attr("detect_positive", 1)), (-1, n.attr("detect_negative", 1))) if on]
    if not signs:
        return cv.emit("expand", np.zeros([1] * cv.meta(x).ndim, np.bool_), shape=cv.meta(x).shape)
    hits = [cv.emit("equal", x, scalar(cv, s * math.inf, x)) for s in signs]
    return hits[0] if len(hits) == 1 else cv.emit("logical_or", *hits)


@onnx_op("Sign")
def sign(cv, n):
    x = n.inputs[0]
    zero = scalar(cv, 0, x)
    negative = cv.emit("where", cv.emit("less", x, zero), scalar(cv, -1, x), zero)
    return cv.emit("where", cv.emit("greater", x, zero), scalar(cv, 1, x), negative)


@onnx_op("BitShift")
def bit_shift(cv, n):
    """x << s is x * 2^s (wrapping) and x >> s is floor(x / 2^s); a shift out of range (negative, or the
    width and beyond) gives 0, or for a right shift of a signed x its sign: -1 where x < 0."""
    x, shift = n.inputs
    np_dtype = dtype(cv.meta(x).dtype).numpy
    width, signed, left = np_dtype.itemsize * 8, np_dtype.kind == "i", n.attr("direction") == "LEFT"
    limit = width - 1 if signed and not left else width          # x >> (width - 1) of a signed x is its sign too
    zero = scalar(cv, 0, x)
    outside = cv.emit("greater_equal", shift, scalar(cv, limit, x))
    if signed:
        outside = cv.emit("logical_or", outside, cv.emit("less", shift, zero))
    power = cv.emit("pow", scalar(cv, 2, x), cv.emit("where", outside, zero, shift))
    if left:
        return cv.emit("where", outside, zero, cv.emit("mul", x, power))
    floored = cv.emit("div", cv.emit("sub", x, cv.emit("mod", x, power, fmod=False)), power)
    fill = cv.emit("where", cv.emit("less", x, zero), scalar(cv, -1, x), zero) if signed else zero
    return cv.emit("where", outside, fill, floored)


@onnx_op("Xor")
def xor(cv, n):
    a, b = n.inputs
    b = legacy_broadcast(cv, n, a, b)
    return cv.emit("logical_and", cv.emit("logical_or", a, b), cv.emit("logical_not", cv.emit("logical_and", a, b)))


@onnx_op(*UNARY)
def unary(cv, n):
    return cv.emit(UNARY[n.op_type], n.inputs[0])


@onnx_op(*VARIADIC)
def variadic(cv, n):
    total = n.inputs[0]
    for x in n.inputs[1:]:
        total = cv.emit(VARIADIC[n.op_type], total, x)
    if n.op_type == "Mean":
        total = cv.emit("div", total, scalar(cv, len(n.inputs), total))
    return total


@onnx_op("Tan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Asin", "Acos")
@in_f32
def trigonometric(cv, n):
    """The functions the IR's exp, log, sin, cos and atan write: tan = sin/cos, sinh = (e^x - e^-x)/2,
    asin = atan(x / sqrt(1 - x^2)), acos = pi/2 - asin, ..."""
    x = n.inputs[0]
    one, half = scalar(cv, 1, x), scalar(cv, 0.5, x)
    if n.op_type in ("Asin", "Acos"):
        asin = cv.emit("atan", cv.emit("div", x, cv.emit("sqrt", cv.emit("sub", one, cv.emit("mul", x, x)))))
        return asin if n.op_type == "Asin" else cv.emit("sub", scalar(cv, np.pi / 2, x), asin)
    if n.op_type == "Tan":
        return cv.emit("div", cv.emit("sin", x), cv.emit("cos", x))
    if n.op_type in ("Sinh", "Cosh"):
        ex, e_x = cv.emit("exp", x), cv.emit("exp", cv.emit("neg", x))
        return cv.emit("mul", cv.emit("sub" if n.op_type == "Sinh" else "add", ex, e_x), half)
    if n.op_type == "Atanh":
        return cv.emit("mul", cv.emit("log", cv.emit("div", cv.emit("add", one, x), cv.emit("sub", one, x))), half)
    root = cv.emit("sqrt", cv.emit("add" if n.op_type == "Asinh" else "sub", cv.emit("mul", x, x), one))
    return cv.emit("log", cv.emit("add", x, root))


RANDOM_SEED = 0                 # the generator's seed where a node names none: runs repeat exactly
NOISE_TABLE = 1 << 20           # noise of a size only the run decides is read from this many draws, cycling


@onnx_op("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike")
def random(cv, n):
    """Noise drawn once, when the graph is built, from a generator seeded by the node's `seed` (else
    RANDOM_SEED): a model that samples (a VITS voice's noise) gives the same output for the same input.
    Noise of a symbolic shape is the first of a table of draws (the same numbers, for any size)."""
    like = n.input(0)
    shape = tuple(n.attr("shape")) if like is None else cv.meta(like).shape
    known = all(isinstance(d, int) for d in shape)
    to = n.attr("dtype")
    target = dtype_name(to, cv.where()) if to is not None else (cv.meta(like).dtype if like is not None else "f32")
    rng = np.random.default_rng(int(n.attr("seed", RANDOM_SEED)))
    size = shape if known else NOISE_TABLE
    if "Normal" in n.op_type:
        values = rng.normal(n.attr("mean", 0.0), n.attr("scale", 1.0), size).astype(dtype(target).numpy)
    else:
        values = rng.uniform(n.attr("low", 0.0), n.attr("high", 1.0), size).astype(dtype(target).numpy)
    if known:
        return values
    count = 1
    for d in shape:
        count = count * d
    index = cv.emit("mod", cv.arange(count), np.array(NOISE_TABLE, np.int64), fmod=True)
    return cv.emit("reshape", cv.emit("take", values, index, axis=0), shape=tuple(shape))


@onnx_op("Identity", sequences=True)
def identity(cv, n):
    return n.inputs[0]


@onnx_op("Dropout")
def dropout(cv, n):
    """Inference: the input unchanged, its mask all true."""
    x = n.inputs[0]
    training = n.input(2)
    if training is not None and bool(np.asarray(cv.known(training, "training mode")).reshape(-1)[0]):
        raise cv.unsupported("training-mode dropout draws a random mask: only inference is supported")
    if n.n_outputs < 2:
        return x
    kept = np.ones([1] * cv.meta(x).ndim, np.bool_ if n.opset >= 10 else dtype(cv.meta(x).dtype).numpy)
    return x, cv.emit("expand", kept, shape=cv.meta(x).shape)        # (before opset 10, a mask of x's type)


@onnx_op("Cast")
def cast(cv, n):
    to = n.attr("to")                      # Cast-1 names the type ("FLOAT"); later opsets give its number
    x, target = n.inputs[0], dtype_name(TensorProto.DataType.Value(to) if isinstance(to, str) else to, cv.where())
    if isinstance(x, np.ndarray) and x.dtype == object and target not in ("i32", "i64"):
        x = cv.value(x)                   # symbolic sizes as other numbers: counted when the graph runs
    return x if cv.meta(x).dtype == target else cv.emit("cast", x, dtype=target)


@onnx_op("CastLike")
def cast_like(cv, n):
    return cast_to(cv, n.inputs[0], n.inputs[1])


@onnx_op("Where")
def where(cv, n):
    return cv.emit("where", *n.inputs)


@onnx_op("Clip")
def clip(cv, n):
    x = n.inputs[0]
    if n.opset < 11:
        low, high = n.attr("min", -math.inf), n.attr("max", math.inf)
    else:
        low, high = n.input(1), n.input(2)
    for bound, op in ((low, "maximum"), (high, "minimum")):
        if bound is not None and not (np.isscalar(bound) and math.isinf(bound)):
            x = cv.emit(op, x, cast_to(cv, np.asarray(bound) if np.isscalar(bound) else bound, x))
    return x


# --- activations, as the IR ops their formulas are ------------------------------------------------

def where_positive(cv, x, positive, other):
    return cv.emit("where", cv.emit("greater", x, scalar(cv, 0, x)), positive, other)


def exp_minus_one(cv, x, alpha):
    return cv.emit("mul", scalar(cv, alpha, x), cv.emit("sub", cv.emit("exp", x), scalar(cv, 1, x)))


def softplus_of(cv, x):
    return cv.emit("log", cv.emit("add", cv.emit("exp", x), scalar(cv, 1, x)))


def hard_sigmoid_of(cv, x, alpha, beta):
    y = cv.emit("add", cv.emit("mul", x, scalar(cv, alpha, x)), scalar(cv, beta, x))
    return cv.emit("minimum", cv.emit("maximum", y, scalar(cv, 0, x)), scalar(cv, 1, x))


@onnx_op("LeakyRelu")
def leaky_relu(cv, n):
    return cv.emit("leaky_relu", n.inputs[0], negative_slope=float(n.attr("alpha", 0.01)))


@onnx_op("Elu")
@in_f32
def elu(cv, n):
    x = n.inputs[0]
    return where_positive(cv, x, x, exp_minus_one(cv, x, n.attr("alpha", 1.0)))


@onnx_op("Selu")
@in_f32
def selu(cv, n):
    x = n.inputs[0]
    y = where_positive(cv, x, x, exp_minus_one(cv, x, n.attr("alpha", 1.67326319217681884765625)))
    return cv.emit("mul", y, scalar(cv, n.attr("gamma", 1.05070102214813232421875), x))


@onnx_op("Celu")
@in_f32
def celu(cv, n):
    x, alpha = n.inputs[0], n.attr("alpha", 1.0)
    negative = exp_minus_one(cv, cv.emit("div", x, scalar(cv, alpha, x)), alpha)
    return cv.emit("add", cv.emit("relu", x), cv.emit("minimum", negative, scalar(cv, 0, x)))


@onnx_op("ThresholdedRelu")
def thresholded_relu(cv, n):
    x = n.inputs[0]
    return cv.emit("where", cv.emit("greater", x, scalar(cv, n.attr("alpha", 1.0), x)), x, scalar(cv, 0, x))


@onnx_op("PRelu")
@in_f32
def prelu(cv, n):
    x, slope = n.inputs
    return where_positive(cv, x, x, cv.emit("mul", x, slope))


@onnx_op("HardSigmoid")
@in_f32
def hard_sigmoid(cv, n):
    return hard_sigmoid_of(cv, n.inputs[0], n.attr("alpha", 0.2), n.attr("beta", 0.5))


@onnx_op("HardSwish")
@in_f32
def hard_swish(cv, n):
    x = n.inputs[0]
    return cv.emit("mul", x, hard_sigmoid_of(cv, x, 1 / 6, 0.5))


@onnx_op("Softplus")
@in_f32
def softplus(cv, n):
    return softplus_of(cv, n.inputs[0])


@onnx_op("Softsign")
@in_f32
def softsign(cv, n):
    x = n.inputs[0]
    return cv.emit("div", x, cv.emit("add", cv.emit("abs", x), scalar(cv, 1, x)))


@onnx_op("Mish")
@in_f32
def mish(cv, n):
    x = n.inputs[0]
    return cv.emit("mul", x, cv.emit("tanh", softplus_of(cv, x)))


@onnx_op("Swish")
@in_f32
def swish(cv, n):
    x = n.inputs[0]
    return cv.emit("mul", x, cv.emit("sigmoid", cv.emit("mul", x, scalar(cv, n.attr("alpha", 1.0), x))))


@onnx_op("Gelu")
def gelu(cv, n):
    return cv.emit("gelu", n.inputs[0], approximate=n.attr("approximate", "none"))


@onnx_op("Shrink")
@in_f32
def shrink(cv, n):
    x, bias, lambd = n.inputs[0], n.attr("bias", 0.0), n.attr("lambd", 0.5)
    zero = scalar(cv, 0, x)
    above = cv.emit("where", cv.emit("greater", x, scalar(cv, lambd, x)), cv.emit("sub", x, scalar(cv, bias, x)), zero)
    return cv.emit("where", cv.emit("less", x, scalar(cv, -lambd, x)), cv.emit("add", x, scalar(cv, bias, x)), above)


@onnx_op("Binarizer", domain="ai.onnx.ml")
def binarizer(cv, n):
    """1 where x is above the threshold, else 0, in x's dtype."""
    x = n.inputs[0]
    above = cv.emit("greater", x, scalar(cv, n.attr("threshold", 0.0), x))
    return cv.emit("cast", above, dtype=cv.meta(x).dtype)


# --- the experimental ops of opset 1 that onnxruntime still runs (ONNX dropped their schemas) ---------

@onnx_op("ImageScaler")
def image_scaler(cv, n):
    """x * scale + bias, a bias per channel of [N, C, H, W]."""
    x, bias = n.inputs[0], n.attr("bias")
    if bias is None or len(bias) != cv.meta(x).shape[1]:
        raise cv.invalid(f"its bias {bias} is not one per channel of {list(cv.meta(x).shape)}")
    bias = np.array(bias, dtype(cv.meta(x).dtype).numpy).reshape(-1, *[1] * (cv.meta(x).ndim - 2))
    return cv.emit("add", cv.emit("mul", x, scalar(cv, n.attr("scale", 1.0), x)), bias)


@onnx_op("Scale", "Affine")
def affine(cv, n):
    """Scale: x * scale; Affine: x * alpha + beta."""
    x = n.inputs[0]
    if n.op_type == "Scale":
        return cv.emit("mul", x, scalar(cv, n.attr("scale", 1.0), x))
    return cv.emit("add", cv.emit("mul", x, scalar(cv, n.attr("alpha", 1.0), x)), scalar(cv, n.attr("beta", 0.0), x))


@onnx_op("ScaledTanh", "ParametricSoftplus")
@in_f32
def scaled(cv, n):
    """alpha * f(beta * x), f tanh or softplus; both attributes required, as onnxruntime has them."""
    x, alpha, beta = n.inputs[0], n.attr("alpha"), n.attr("beta")
    if alpha is None or beta is None:
        raise cv.invalid("it needs both `alpha` and `beta`")
    inner = cv.emit("mul", x, scalar(cv, beta, x))
    f = cv.emit("tanh", inner) if n.op_type == "ScaledTanh" else softplus_of(cv, inner)
    return cv.emit("mul", f, scalar(cv, alpha, x))

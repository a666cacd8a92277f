"""onnxruntime's contrib ops (the com.microsoft domain, and the few it registers in ai.onnx) that its own
tools write: the gelus, skip and simplified layer norms, MatMulNBits, FusedConv, Attention. Each as
onnxruntime's ContribOperators.md defines it, in the IR's ops; it must not know onnxruntime's kernels."""
from __future__ import annotations

import numpy as np

from soma_runtime.loaders.onnx.ops import nn
from soma_runtime.loaders.onnx.ops.elementwise import hard_sigmoid_of, scalar
from soma_runtime.loaders.onnx.ops.layout import reshape_to
from soma_runtime.loaders.onnx.ops.table import onnx_op

MS = "com.microsoft"


def biased(cv, x, bias):
    return x if bias is None else cv.emit("add", x, bias)


@onnx_op("Gelu", domain=MS)
def gelu(cv, n):
    return cv.emit("gelu", n.inputs[0], approximate="none")


@onnx_op("BiasGelu", domain=MS)
def bias_gelu(cv, n):
    return cv.emit("gelu", biased(cv, n.inputs[0], n.input(1)), approximate="none")


@onnx_op("FastGelu", domain=MS)
def fast_gelu(cv, n):
    return cv.emit("gelu", biased(cv, n.inputs[0], n.input(1)), approximate="tanh")


@onnx_op("QuickGelu", domain=MS)
def quick_gelu(cv, n):
    x = n.inputs[0]
    return cv.emit("mul", x, cv.emit("sigmoid", cv.emit("mul", x, scalar(cv, n.attr("alpha", 1.702), x))))


def moments(cv, x, eps: float, centered: bool):
    """The mean (0 where not `centered`) and 1 / sqrt(variance + eps) over the last axis, kept as size 1."""
    last = (cv.meta(x).ndim - 1,)
    mean = cv.emit("reduce_mean", x, axes=last, keepdims=True) if centered else None
    d = cv.emit("sub", x, mean) if centered else x
    var = cv.emit("reduce_mean", cv.emit("mul", d, d), axes=last, keepdims=True)
    return mean, cv.emit("rsqrt", cv.emit("add", var, scalar(cv, eps, x)))


def skip_sum(cv, n, bias_at: int):
    x = cv.emit("add", n.inputs[0], n.inputs[1])
    return biased(cv, x, n.input(bias_at))


@onnx_op("SkipLayerNormalization", domain=MS)
def skip_layer_norm(cv, n):
    """layernorm(input + skip + bias) * gamma + beta; outputs y, mean, 1 / std, and the sum."""
    total = skip_sum(cv, n, 4)
    eps = float(n.attr("epsilon", 1e-12))
    y = cv.emit("layernorm", total, n.inputs[2], n.input(3), eps=eps)
    mean, inv = moments(cv, total, eps, centered=True) if n.n_outputs in (2, 3) else (None, None)
    return [y, mean, inv, total][:n.n_outputs]


@onnx_op("SkipSimplifiedLayerNormalization", domain=MS)
def skip_simplified_layer_norm(cv, n):
    """rmsnorm(input + skip + bias) * gamma; outputs y, mean (unused), 1 / rms, and the sum."""
    total = skip_sum(cv, n, 3)
    eps = float(n.attr("epsilon", 1e-12))
    y = cv.emit("rmsnorm", total, n.inputs[2], eps=eps)
    inv = moments(cv, total, eps, centered=False)[1] if n.n_outputs in (2, 3) else None
    return [y, None, inv, total][:n.n_outputs]


@onnx_op("SimplifiedLayerNormalization")
@onnx_op("SimplifiedLayerNormalization", domain=MS)
def simplified_layer_norm(cv, n):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis (the only one its exporters use)."""
    x, weight = n.inputs[0], n.inputs[1]
    rank = cv.meta(x).ndim
    if cv.axis(n.attr("axis", -1), rank) != rank - 1:
        raise cv.unsupported(f"normalizing from axis {n.attr('axis')} (only the last axis is supported)")
    eps = float(n.attr("epsilon", 1e-5))
    y = cv.emit("rmsnorm", x, weight, eps=eps)
    return [y, moments(cv, x, eps, centered=False)[1]][:n.n_outputs] if n.n_outputs > 1 else y


ACTIVATIONS = {
    "Relu": lambda cv, x, p: cv.emit("relu", x),
    "Tanh": lambda cv, x, p: cv.emit("tanh", x),
    "Sigmoid": lambda cv, x, p: cv.emit("sigmoid", x),
    "LeakyRelu": lambda cv, x, p: cv.emit("leaky_relu", x, negative_slope=float(p[0] if p else 0.01)),
    "Clip": lambda cv, x, p: cv.emit("clip", x, min=float(p[0]), max=float(p[1])),
    "HardSigmoid": lambda cv, x, p: hard_sigmoid_of(cv, x, float(p[0]), float(p[1])),
}


@onnx_op("FusedConv", domain=MS)
def fused_conv(cv, n):
    """activation(conv(x, w, b) + z), the activation and its parameters named by attributes."""
    activation = n.attr("activation", "")
    if activation and activation not in ACTIVATIONS:
        raise cv.unsupported(f"FusedConv's activation {activation!r}")
    y = biased(cv, nn.conv(cv, n), n.input(3))
    return ACTIVATIONS[activation](cv, y, list(n.attr("activation_params", []))) if activation else y


def unpacked(packed: np.ndarray, bits: int) -> np.ndarray:
    """Bytes holding 8 // bits values each, the lowest bits first, as one value per element."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:-1], -1)


@onnx_op("MatMulNBits", domain=MS)
def matmul_nbits(cv, n):
    """A @ W.T + bias for W [N, K] stored as `bits`-bit integers in blocks of `block_size` along K, each
    block (q - zero point) * its scale; the zero point 2^(bits-1) where none is given. Dequantized at load."""
    a, packed, scales, zeros = n.inputs[0], n.inputs[1], n.inputs[2], n.input(3)
    bits, block = int(n.attr("bits", 4)), int(n.attr("block_size"))
    k, rows = int(n.attr("K")), int(n.attr("N"))
    if bits not in (2, 4, 8):
        raise cv.unsupported(f"{bits}-bit weights (2, 4 and 8 bits are supported)")
    if n.input(4) is not None:
        raise cv.unsupported("a g_idx input (act-order weights)")
    packed = cv.known(packed, "packed weights")
    scales = cv.known(scales, "scales").astype(np.float32)
    blocks = -(-k // block)
    q = unpacked(packed.reshape(rows, blocks, -1), bits)[:, :, :block].astype(np.float32)      # [N, blocks, block]
    if zeros is None:
        zero = np.float32(1 << (bits - 1))
    else:
        zeros = cv.known(zeros, "zero points")
        if zeros.dtype != np.uint8:
            raise cv.unsupported(f"{zeros.dtype} zero points (packed uint8 ones are supported)")
        zero = unpacked(zeros.reshape(rows, -1), bits)[:, :blocks].astype(np.float32)[..., None]
    w = ((q - zero) * scales.reshape(rows, blocks, 1)).reshape(rows, -1)[:, :k]
    y = cv.emit("matmul", cv.emit("cast", a, dtype="f32") if cv.meta(a).dtype != "f32" else a,
                np.ascontiguousarray(w), transpose_b=True)
    y = y if cv.meta(a).dtype == "f32" else cv.emit("cast", y, dtype=cv.meta(a).dtype)
    return biased(cv, y, n.input(5))

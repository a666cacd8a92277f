"""CPU jets for elementwise ops, activations, norms and softmax: numpy over whole tensors, and numba
loops for the f32 shapes a decode step calls hundreds of times (where numpy's temporaries dominate)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, vectorize

from soma_runtime.backends.cpu.common import CPU, INTEGER, REAL, F, all_f32, deliver, dense, float_kernel, out_f32
from soma_runtime.backends.cpu.simd import exp_f32
from soma_runtime.dtypes import dtype_of, truncated_quotient
from soma_runtime.ir.jets import jet


@vectorize(["float32(float32)", "float64(float64)"], cache=True)
def erf(x):
    return math.erf(x)


def sigmoid_f32(x):
    return 1 / (1 + np.exp(-x))


def gelu_f32(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * (x + np.float32(0.044715) * x * x * x)))
    return 0.5 * x * (1 + erf(x * np.float32(1 / math.sqrt(2))))


def binary_jet(ufunc):
    general = float_kernel(lambda a, b: ufunc(a, b))

    def run(a, b, out=None):
        fits = out is not None and all_f32(a, b, out) and out.flags.c_contiguous
        if fits and np.broadcast_shapes(a.shape, b.shape) == out.shape:
            return ufunc(a, b, out=out)           # residual and bias adds straight into the planned buffer
        return general(a, b, out=out)
    run.__name__ = ufunc.__name__
    return run


def truncated_divide(a, b, out=None):
    """Integer division rounding toward zero (numpy's // floors)."""
    return deliver(truncated_quotient(a, b), dtype_of(a), out)


BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
for _name, _fn in BINARY.items():
    jet(_name, CPU, [(REAL, REAL)] + ([] if _name == "div" else [(INTEGER, INTEGER)]))(binary_jet(_fn))
jet("div", CPU, [(INTEGER, INTEGER)])(truncated_divide)


@jet("mod", CPU, [(REAL, REAL), (INTEGER, INTEGER)])
@float_kernel
def mod(a, b, fmod=False):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.fmod(a, b) if fmod else np.mod(a, b)


@jet("silu", CPU, [(F,)])
@float_kernel
def silu(x): return x * sigmoid_f32(x)


@jet("sigmoid", CPU, [(F,)])
@float_kernel
def sigmoid(x): return sigmoid_f32(x)


@jet("tanh", CPU, [(F,)])
@float_kernel
def tanh(x): return np.tanh(x)


@jet("relu", CPU, [(F,)])
@float_kernel
def relu(x): return np.maximum(x, 0)


@jet("leaky_relu", CPU, [(F,)])
@float_kernel
def leaky_relu(x, negative_slope):
    """max(x, slope * x) where the slope is at most 1 (two passes over x, not where's four)."""
    scaled = x * np.float32(negative_slope)
    return np.maximum(x, scaled, out=scaled) if 0 <= negative_slope <= 1 else np.where(x > 0, x, scaled)


# erf as Eigen's rational approximation on [-4, 4] (|error| < 5e-7): it vectorizes, libm's erf does not
P0, P1, P2, P3, P4, P5, P6 = (np.float32(c) for c in (
    -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
    -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02))
Q0, Q1, Q2, Q3, Q4 = (np.float32(c) for c in (
    -1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
    -1.42647390514189e-02))


# serial on purpose: these run between BLAS calls, and a parallel region's spinning workers would
# take the cores from BLAS's threads (measured: 2x slower encoder matmuls). error_model="numpy":
# IEEE division (no zero check), which lets LLVM vectorize the loop
@njit(inline="always", error_model="numpy")
def gelu_erf(v):
    z = min(max(v * np.float32(1 / math.sqrt(2)), np.float32(-4)), np.float32(4))
    z2 = z * z
    p = ((((((P0 * z2 + P1) * z2 + P2) * z2 + P3) * z2 + P4) * z2 + P5) * z2 + P6) * z
    q = (((Q0 * z2 + Q1) * z2 + Q2) * z2 + Q3) * z2 + Q4
    return np.float32(0.5) * v * (np.float32(1) + p / q)


@njit(inline="always", error_model="numpy")
def gelu_tanh(v):
    inner = np.float32(math.sqrt(2 / math.pi)) * (v + np.float32(0.044715) * v * v * v)
    return np.float32(0.5) * v * (np.float32(1) + np.tanh(inner))


@njit(cache=True, error_model="numpy")
def gelu_in_place(values, tanh):
    """gelu over one flat array, in place: with a single array the loop vectorizes (a kernel given
    the same array as input and output fails LLVM's overlap check and runs scalar, 5x slower)."""
    if tanh:
        for i in range(values.size):
            values[i] = gelu_tanh(values[i])
    else:
        for i in range(values.size):
            values[i] = gelu_erf(values[i])


@njit(cache=True, error_model="numpy")
def _gelu_erf(x, out):
    flat, dst = x.reshape(-1), out.reshape(-1)
    for i in range(flat.size):
        dst[i] = gelu_erf(flat[i])


@jet("gelu", CPU, [(F,)])
def gelu(x, out=None, approximate="none"):
    if approximate == "none" and all_f32(x):
        result = out_f32(out, x.shape)
        _gelu_erf(dense(x), result)
        return result
    return _gelu_numpy(x, approximate=approximate, out=out)


@float_kernel
def _gelu_numpy(x, approximate): return gelu_f32(x, approximate)


@njit(cache=True, error_model="numpy")
def _swiglu(gate, up, out):
    for i in range(gate.size):
        g = gate.flat[i]
        out.flat[i] = g / (np.float32(1) + exp_f32(-g)) * up.flat[i]


@jet("swiglu", CPU, [(F, F)])
def swiglu(gate, up, out=None):
    if all_f32(gate, up) and gate.shape == up.shape:
        result = out_f32(out, gate.shape)
        _swiglu(dense(gate), dense(up), result)
        return result
    return _swiglu_numpy(gate, up, out=out)


@float_kernel
def _swiglu_numpy(gate, up): return gate * sigmoid_f32(gate) * up


@jet("geglu", CPU, [(F, F)])
@float_kernel
def geglu(gate, up, approximate): return gelu_f32(gate, approximate) * up


@njit(cache=True, error_model="numpy")
def rmsnorm_rows(x, weight, eps, out):
    n = x.shape[1]
    for r in range(x.shape[0]):
        total = 0.0
        for i in range(n):
            total += np.float64(x[r, i] * x[r, i])        # squares in f32, their sum in f64: as ggml
        inv = np.float32(1) / np.sqrt(np.float32(total / n) + eps)
        for i in range(n):
            out[r, i] = x[r, i] * inv * weight[i]


@jet("rmsnorm", CPU, [(F, F), (F, "none")])
def rmsnorm(x, weight, out=None, eps=1e-6):
    if weight is not None and all_f32(x, weight) and x.ndim >= 2 and weight.shape == x.shape[-1:]:
        result = out_f32(out, x.shape)
        rmsnorm_rows(dense(x).reshape(-1, x.shape[-1]), dense(weight), np.float32(eps), result.reshape(-1, x.shape[-1]))
        return result
    return _rmsnorm_numpy(x, weight, eps=eps, out=out)


@float_kernel
def _rmsnorm_numpy(x, weight, eps):
    # the mean of squares accumulates in f64 (as ggml does), then scales in f32
    mean = (np.sum(x * x, axis=-1, keepdims=True, dtype=np.float64) / x.shape[-1]).astype(np.float32)
    y = x * (np.float32(1) / np.sqrt(mean + np.float32(eps)))
    return y if weight is None else y * weight


def normalize(x, axis, eps):
    centered = x - x.mean(axis=axis, keepdims=True)
    return centered / np.sqrt((centered * centered).mean(axis=axis, keepdims=True) + np.float32(eps))


def affine(y, weight, bias, shape):
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


OPTIONAL2 = [(F, a, b) for a in (F, "none") for b in (F, "none")]


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz"})
def _layernorm_rows(x, weight, bias, eps, out):
    """Serial, as _gelu_erf; each row's sums reassociate into SIMD lanes (the same order whatever the batch)."""
    n = x.shape[1]
    for r in range(x.shape[0]):
        mean = np.float32(0)
        for i in range(n):
            mean += x[r, i]
        mean /= n
        var = np.float32(0)
        for i in range(n):
            var += (x[r, i] - mean) * (x[r, i] - mean)
        inv = np.float32(1) / np.sqrt(var / n + eps)
        for i in range(n):
            out[r, i] = (x[r, i] - mean) * inv * weight[i] + bias[i]


@jet("layernorm", CPU, OPTIONAL2)
def layernorm(x, weight, bias, out=None, eps=1e-5):
    if weight is not None and bias is not None and all_f32(x, weight, bias) and x.ndim >= 2:
        result = out_f32(out, x.shape)
        _layernorm_rows(dense(x).reshape(-1, x.shape[-1]), dense(weight), dense(bias), np.float32(eps),
                        result.reshape(-1, x.shape[-1]))
        return result
    return _layernorm_numpy(x, weight, bias, eps=eps, out=out)


@float_kernel
def _layernorm_numpy(x, weight, bias, eps): return affine(normalize(x, -1, eps), weight, bias, (-1,))


@jet("groupnorm", CPU, OPTIONAL2)
@float_kernel
def groupnorm(x, weight, bias, groups, eps):
    y = normalize(x.reshape(x.shape[0], groups, -1), -1, eps).reshape(x.shape)
    return affine(y, weight, bias, (x.shape[1],) + (1,) * (x.ndim - 2))


@jet("batchnorm", CPU, [(F, F, F, a, b) for a in (F, "none") for b in (F, "none")])
@float_kernel
def batchnorm(x, mean, var, weight, bias, eps):
    shape = (x.shape[1],) + (1,) * (x.ndim - 2)
    y = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + np.float32(eps))
    return affine(y, weight, bias, shape)


def attention_bias(rows: int, cols: int, causal: bool, window: int) -> np.ndarray:
    """Additive [rows, cols] mask: 0 where query i may see key j, -inf elsewhere (bottom-right aligned)."""
    q = np.arange(rows)[:, None] + (cols - rows)
    k = np.arange(cols)[None, :]
    keep = np.ones((rows, cols), bool)
    if causal:
        keep &= k <= q
    if window:
        keep &= q - k < window
    return np.where(keep, np.float32(0), np.float32(-np.inf))


def softmax_f32(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@jet("softmax", CPU, [(F, F), (F, "none")])
@float_kernel
def softmax(x, mask, axis, causal, window):
    if mask is not None:
        x = x + mask
    if causal or window:
        rows = x.shape[-2] if x.ndim >= 2 else 1
        x = x + attention_bias(rows, x.shape[-1], causal, window)
    return softmax_f32(x, axis)


@jet("where", CPU, [("bool", t, t) for t in (REAL, INTEGER, "bool")])
def where(cond, a, b, out=None):
    return deliver(np.where(cond, a, b), dtype_of(a), out)

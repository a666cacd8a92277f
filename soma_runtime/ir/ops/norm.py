"""Normalizations (rms, layer, group, batch) and softmax."""
from __future__ import annotations

from soma_runtime.ir.ops.base import (
    attention_mask,
    broadcast_shapes,
    check,
    float_dtype,
    op,
    per_channel,
    same_dtype,
    softmax_atoms,
)


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

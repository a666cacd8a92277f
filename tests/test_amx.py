"""bf16 matmuls on the CPU's matrix units (backends/cpu/amx.py) against torch in the same run.

With AMX the kernel must equal bf16-rounded activations times the bf16 weights, accumulated in
f32 (torch's and llama.cpp's bf16 product); elsewhere the same op falls back to f32 activations,
which stays within bf16's rounding of the product."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from soma_runtime.backends.cpu import amx
from soma_runtime.dtypes import dtype
from soma_runtime.ir.jets import run_op

SHAPES = [(9, 32, 32), (33, 64, 96), (70, 96, 64), (128, 256, 512), (3, 64, 64), (40, 48, 64)]   # last two: GEMV rows, N not in 32s


def inputs(rows, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, rows, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(dtype("bf16").numpy)
    return x, w, rng.standard_normal(n).astype(np.float32)


def bf16_product(x, w, bias):
    return (torch.from_numpy(x).bfloat16().float() @ torch.from_numpy(w.astype(np.float32)).T + torch.from_numpy(bias)).numpy()


@pytest.mark.skipif(not amx.available(), reason="this CPU has no AMX-BF16 (or numba targets another CPU)")
@pytest.mark.parametrize("rows,n,k", [s for s in SHAPES if s[0] > 8 and s[1] % 32 == 0])
def test_amx_matmul_equals_bf16_rounded_product(rows, n, k):
    x, w, bias = inputs(rows, n, k)
    assert amx.takes(x, w, 8)
    got = run_op("matmul", x, w, bias, transpose_b=True, activations="bf16")
    want = bf16_product(x, w, bias)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_bf16_activation_matmul_stays_within_bf16_rounding(rows, n, k):
    x, w, bias = inputs(rows, n, k, seed=1)
    got = run_op("matmul", x, w, bias, transpose_b=True, activations="bf16")
    exact = (torch.from_numpy(x) @ torch.from_numpy(w.astype(np.float32)).T + torch.from_numpy(bias)).numpy()
    scale = np.abs(x).max() * np.abs(w.astype(np.float32)).max() * k
    assert np.abs(got - exact).max() <= 2 ** -8 * scale


def test_amx_leaves_f32_activations_and_other_dtypes_alone():
    x, w, _ = inputs(64, 64, 64)
    assert not amx.takes(x, w.astype(np.float16), 8)
    assert not amx.takes(x, w.astype(np.float32), 8)
    assert not amx.takes(x[:, :4], w, 8) and amx.takes(x[:, :4], w, 0) == amx.available()

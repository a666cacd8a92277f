"""bf16 matmuls on the CPU's matrix units (backends/cpu/amx.py) against torch in the same run.

With AMX the kernel must equal bf16-rounded activations times the bf16 weights, accumulated in
f32 (torch's and llama.cpp's bf16 product); elsewhere the same op falls back to f32 activations,
which stays within bf16's rounding of the product."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from soma_runtime.backends import run_op
from soma_runtime.backends.cpu import amx
from soma_runtime.dtypes import dtype

# last two: GEMV rows, N not in 32s
SHAPES = [(9, 32, 32), (33, 64, 96), (70, 96, 64), (128, 256, 512), (3, 64, 64), (40, 48, 64)]


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


@pytest.mark.skipif(not amx.available(), reason="this CPU has no AMX-BF16 (or numba targets another CPU)")
@pytest.mark.parametrize("heads,kv_heads,rows,keys,dim", [(4, 4, 7, 7, 32), (4, 2, 20, 37, 64), (2, 1, 33, 33, 32)])
def test_amx_attention_equals_bf16_rounded_attention(heads, kv_heads, rows, keys, dim):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, heads, rows, dim)).astype(np.float32)
    k, v = (rng.standard_normal((2, kv_heads, keys, dim)).astype(np.float32) for _ in range(2))
    mask = np.where(rng.random((2, 1, 1, keys)) < 0.2, -np.inf, 0).astype(np.float32)
    mask[..., 0] = 0                                         # every row sees a key
    got = run_op("sdpa", q, k, v, mask, precision="bf16")
    tq, tk, tv = (torch.from_numpy(t).bfloat16().float() for t in (q, k, v))
    tk, tv = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (tk, tv))
    probs = torch.softmax(tq @ tk.transpose(-1, -2) / dim ** 0.5 + torch.from_numpy(mask), -1)
    want = (probs.bfloat16().float() @ tv).numpy()
    assert np.abs(got - want).max() <= 2e-3 * max(1.0, np.abs(want).max())


@pytest.mark.skipif(not amx.available(), reason="this CPU has no AMX-BF16 (or numba targets another CPU)")
@pytest.mark.parametrize("epilogue,approximate", [("gelu", "none"), ("gelu_tanh", "tanh")])
@pytest.mark.parametrize("rows", [40, 64])                  # a partial last block, and whole blocks
@pytest.mark.parametrize("repack", [True, False])           # repacked weights, or read in place past the budget
def test_amx_matmul_applies_its_epilogue(epilogue, approximate, rows, repack, monkeypatch):
    if not repack:
        monkeypatch.setattr(amx, "PACK_BUDGET", 0)
    x, w, bias = inputs(rows, 64, 96, seed=3)
    got = run_op("matmul", x, w, bias, transpose_b=True, activations="bf16", epilogue=epilogue)
    want = torch.nn.functional.gelu(torch.from_numpy(bf16_product(x, w, bias)), approximate=approximate).numpy()
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.skipif(not amx.available(), reason="this CPU has no AMX-BF16 (or numba targets another CPU)")
@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0"])
def test_amx_prefill_of_quantized_weights_equals_bf16_product(name):
    """The autotune's "amx" prefill variant: weight tiles decoded to bf16, activations rounded to bf16."""
    from soma_runtime.backends.cpu import qmatmul
    from soma_runtime.quant import dequantize, quantize
    rng = np.random.default_rng(4)
    w = quantize(rng.standard_normal((96, 128)).astype(np.float32), name)
    x = rng.standard_normal((70, 128)).astype(np.float32)
    assert "amx" in qmatmul.variant_names(w)
    got = amx.quantized_matmul(x, w.data, w.dtype.ggml_id, 96)
    dense = dequantize(w).astype(np.float32)
    want = (torch.from_numpy(x).bfloat16().float() @ torch.from_numpy(dense).bfloat16().float().T).numpy()
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())

"""Quantized tensors against the `gguf` package's reference, and quantized matmul jets against
dequantize-then-matmul and against the f32 weights they came from."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from soma_runtime.backends import run_op
from soma_runtime.dtypes import QUANTIZED, QTensor, dtype
from soma_runtime.quant import dequantize, quantize
from tests.backends import BACKENDS

COMPUTE = [b for b in BACKENDS if b != "reference"]       # the backends with quantized-matmul jets

# byte offsets of the f16 scale fields in each block; random bytes there could be NaN/inf
SCALE_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0], "q2_K": [80, 82],
                "q3_K": [108], "q4_K": [0, 2], "q5_K": [0, 2], "q6_K": [208], "tq1_0": [52], "tq2_0": [64]}


def random_blocks(name: str, rows: int, cols: int, seed=0) -> np.ndarray:
    """Random packed bytes with finite, modest f16 scales: every bit pattern of the quants is hit."""
    d = dtype(name)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * cols // d.block_size, d.type_size), dtype=np.uint8)
    for off in SCALE_FIELDS[name]:
        scales = (rng.standard_normal(data.shape[0]) * 0.05).astype(np.float16)
        data[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


def test_every_listed_format_has_a_scale_map():
    assert set(SCALE_FIELDS) == set(QUANTIZED)


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantize_matches_gguf_reference(name):
    raw = random_blocks(name, 6, 512)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(dtype(name).ggml_id))
    got = dequantize(QTensor(raw.reshape(-1), name, (6, 512)))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantize_selected_rows(name):
    raw = random_blocks(name, 5, 256, seed=1)
    t = QTensor(raw.reshape(-1), name, (5, 256))
    np.testing.assert_array_equal(dequantize(t, rows=np.array([[4, 0], [2, 2]])), dequantize(t)[[[4, 0], [2, 2]]])


@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_half_weights_decode_exactly(name):
    from soma_runtime.quant.formats import dequantize_rows
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(dtype(name).numpy)
    np.testing.assert_array_equal(dequantize_rows(x.view(np.uint8), dtype(name).ggml_id, 64), x.astype(np.float32))


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
def test_quantize_is_byte_identical_to_gguf(name):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    x[0, :32] = 0                      # an all-zero block (d = 0)
    x[1, :32] = 0.5                    # a constant block (max == min)
    x[2] = np.round(x[2] * 4) / 4      # values on rounding ties
    want = gguf.quants.quantize(x, gguf.GGMLQuantizationType(dtype(name).ggml_id))
    np.testing.assert_array_equal(quantize(x, name).data.reshape(-1), want.reshape(-1))


def test_quantize_rejects_bad_shapes_and_formats():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 30), np.float32), "q8_0")
    with pytest.raises(ValueError, match="not supported"):
        quantize(np.zeros((2, 256), np.float32), "q6_K")
    with pytest.raises(ValueError, match="needs"):
        QTensor(np.zeros(10, np.uint8), "q4_0", (1, 32))


@pytest.mark.parametrize("backend", COMPUTE)
@pytest.mark.parametrize("rows", [1, 3, 17])          # GEMV path and tiled GEMM path
@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_matmul_matches_dequantize_then_matmul(name, rows, backend):
    w = QTensor(random_blocks(name, 40, 512).reshape(-1), name, (40, 512))
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    want = torch.from_numpy(x).double() @ torch.from_numpy(dequantize(w)).double().T
    got = run_op("matmul", x, w, backend=backend, transpose_b=True)
    scale = max(1.0, float(want.abs().max()))
    assert np.max(np.abs(got - want.numpy())) <= 1e-5 * scale


@pytest.mark.parametrize("backend", COMPUTE)
@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0", "q6_K"])
def test_quantized_matmul_adds_the_residual(name, rows, backend):
    """The residual stream joins inside the kernels (decode) or after them (prefill): the same sum."""
    w = QTensor(random_blocks(name, 40, 512).reshape(-1), name, (40, 512))
    x, residual = (np.random.default_rng(rows + i).standard_normal(shape).astype(np.float32)
                   for i, shape in enumerate([(rows, 512), (rows, 40)]))
    want = torch.from_numpy(x).double() @ torch.from_numpy(dequantize(w)).double().T + torch.from_numpy(residual).double()
    got = run_op("matmul", x, w, None, residual, backend=backend, transpose_b=True)
    assert np.max(np.abs(got - want.numpy())) <= 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("backend", [b for b in COMPUTE if b != "cpu"])
@pytest.mark.parametrize("rows,cols", [(1, 512), (17, 512), (1, 8448)])    # 8448: a row too long for one program's quantization
@pytest.mark.parametrize("name,activations", [("q4_0", "q8"), ("q8_0", "q8"), ("q4_0", "f32"), ("q4_K", "f32")])
def test_normalized_quantized_matmul_agrees_with_cpu(name, activations, rows, cols, backend):
    """rmsnorm folded into the product (into the activations' quantization under q8) gives the CPU's
    numbers, which normalize first."""
    w = QTensor(random_blocks(name, 40, cols).reshape(-1), name, (40, cols))
    rng = np.random.default_rng(rows)
    x, norm = rng.standard_normal((rows, cols)).astype(np.float32), rng.uniform(0.5, 1.5, cols).astype(np.float32)
    want = run_op("matmul", x, w, None, None, norm, backend="cpu", transpose_b=True, activations=activations)
    got = run_op("matmul", x, w, None, None, norm, backend=backend, transpose_b=True, activations=activations)
    assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("backend", COMPUTE)
@pytest.mark.parametrize("rows,cols", [(1, 512), (17, 512), (1, 8192)])       # 8192: one-row programs, widened to a pair
@pytest.mark.parametrize("name,activations", [("q4_0", "q8"), ("q4_K", "f32")])
def test_gated_quantized_matmul_gates_the_products_column_pairs(name, activations, rows, cols, backend):
    """A gated MLP's fused gate/up (rows interleaved) under swiglu: silu of each even column of the
    product times the odd one after it, as torch computes it from the CPU's plain product."""
    w = QTensor(random_blocks(name, 40, cols).reshape(-1), name, (40, cols))
    rng = np.random.default_rng(rows)
    x, norm = rng.standard_normal((rows, cols)).astype(np.float32), rng.uniform(0.5, 1.5, cols).astype(np.float32)
    y = torch.from_numpy(run_op("matmul", x, w, None, None, norm, backend="cpu", transpose_b=True, activations=activations))
    want = (torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]).numpy()
    got = run_op("matmul", x, w, None, None, norm, backend=backend, transpose_b=True, activations=activations, epilogue="swiglu")
    assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("backend", [b for b in COMPUTE if b != "cpu"])
# 96: 3 blocks, a ragged step; 2144: 67, two steps
@pytest.mark.parametrize("rows,cols", [(1, 512), (1, 96), (1, 2144), (17, 512), (17, 96)])
@pytest.mark.parametrize("activations", ["q8", "f32"])
@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0"])
def test_32_block_matmul_agrees_with_cpu(name, activations, rows, cols, backend):
    """llama.cpp's scheme (q8 activations, integer block dots), and f32 activations, give the CPU's
    numbers on every backend, up to the order the blocks are summed in."""
    w = QTensor(random_blocks(name, 40, cols).reshape(-1), name, (40, cols))
    x = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
    want = run_op("matmul", x, w, backend="cpu", transpose_b=True, activations=activations)
    got = run_op("matmul", x, w, backend=backend, transpose_b=True, activations=activations)
    assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, float(np.abs(want).max()))


@pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")
@pytest.mark.parametrize("rows,cols", [(1, 256), (1, 768), (1, 2304), (1, 8192), (17, 768)])   # decode's chunks (of 64 or
@pytest.mark.parametrize("normed", [False, True])                                                 # 128) ragged and many; a prompt
@pytest.mark.parametrize("name", ["q4_K", "q5_K", "q6_K"])
def test_k_quant_matmul_on_cuda_under_q8_activations_is_the_q8_rounded_product(name, rows, cols, normed):
    """On cuda, K-quant weights meet q8 activations in integer dots (as llama.cpp's CUDA kernels do; the
    CPU keeps K-quant activations f32): the exact product of the q8-rounded (normalized) rows."""
    from soma_runtime.backends.cpu.qdot import q8_rounded
    out = 40 if cols < 8192 else 8                    # (the interpreter's time goes with the weight's size)
    w = QTensor(random_blocks(name, out, cols).reshape(-1), name, (out, cols))
    rng = np.random.default_rng(cols)
    x, g = rng.standard_normal((rows, cols)).astype(np.float32), rng.uniform(0.5, 1.5, cols).astype(np.float32)
    norm = g if normed else None
    rows = run_op("rmsnorm", x, g, backend="cpu", eps=1e-6) if normed else x
    want = torch.from_numpy(q8_rounded(rows)).double() @ torch.from_numpy(dequantize(w)).double().T
    got = run_op("matmul", x, w, None, None, norm, backend="cuda", transpose_b=True, activations="q8", norm_eps=1e-6)
    assert np.max(np.abs(got - want.numpy())) <= 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("name,rel_error", [("q8_0", 0.01), ("q4_0", 0.15), ("q4_1", 0.12)])
def test_quantized_matmul_stays_within_format_error(name, rel_error):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    want = (torch.from_numpy(x) @ torch.from_numpy(w).T).numpy()
    got = run_op("matmul", x, quantize(w, name), backend="cpu", transpose_b=True)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < rel_error


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["f16", "bf16"])
@pytest.mark.parametrize("shape", [(24, 96), (40, 300), (24, 2100), (24576, 40)])
def test_half_weight_matmul_matches_torch(backend, name, shape):
    """f32 rows against f16/bf16 weights at f32 accuracy: one row (matrix-vector, K in one step or
    three), a decode batch (on cuda, bf16 weights: f32 rows split in three bf16 parts, K split across
    programs or not), a prompt."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(dtype(name).numpy)
    for rows in (1, 6, 40, 70) if shape[0] < 1000 else (6,):
        x = rng.standard_normal((rows, shape[1])).astype(np.float32)
        residual = rng.standard_normal((rows, shape[0])).astype(np.float32)
        want = torch.from_numpy(x) @ torch.from_numpy(w.astype(np.float32)).T + torch.from_numpy(residual)
        got = run_op("matmul", x, w, None, residual, backend=backend, transpose_b=True)
        assert np.max(np.abs(got - want.numpy())) <= 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")
@pytest.mark.parametrize("cols", [96, 256])
@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0", "q4_K", "q5_K", "q6_K"])
def test_device_weights_come_back_byte_identical(name, cols):
    """The device's layout of a quantized weight (planar for the 32-weight formats) is a regrouping:
    fetched back, the GGUF bytes are the same."""
    from soma_runtime.backends.cuda import fetch, place
    cols = cols if dtype(name).block_size == 32 else 256
    w = QTensor(random_blocks(name, 5, cols).reshape(-1), name, (5, cols))
    back = fetch(place(w))
    assert back.shape == w.shape and np.array_equal(back.data, w.data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", QUANTIZED)
def test_embedding_reads_quantized_rows(backend, name):
    table = QTensor(random_blocks(name, 12, 256).reshape(-1), name, (12, 256))
    ids = np.array([[3, 11], [0, 3]])
    np.testing.assert_allclose(run_op("embedding", table, ids, backend=backend), dequantize(table)[ids], rtol=0, atol=1e-6)

"""q8-activation matmuls (llama.cpp's scheme) against the `gguf` package's block quantizer, and the
VNNI and portable SIMD paths against each other (they must give the same bits)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from soma_runtime.backends.cpu import qdot
from soma_runtime.dtypes import dtype
from tests.backends.test_quant import random_blocks

NAMES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]


def llama_cpp_reference(x: np.ndarray, blocks: np.ndarray, name: str) -> np.ndarray:
    """Activations as q8_0 blocks (gguf's quantizer); formats with a min add m * s, where s = d * sum(q)
    is stored as f16 (ggml's q8_1). Sums in f64."""
    rows, k = x.shape
    q8 = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(rows, k // 32, 34)
    d = q8[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    q = q8[..., 2:].view(np.int8).astype(np.int64)
    weights = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(dtype(name).ggml_id))
    w = weights.reshape(weights.shape[0], k // 32, 32).astype(np.float64)
    if name in ("q4_1", "q5_1"):       # w = d_w * u + m_w: the u part dots with q, m_w with s
        raw = blocks.reshape(blocks.shape[0], k // 32, -1)
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        amax = np.abs(x.reshape(rows, k // 32, 32)).max(-1)
        s = (np.float32(amax / np.float32(127)) * q.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float64)
        dots = np.einsum("mbj,nbj->mnb", q * d[..., None], w - m[..., None])
        return (dots + m[None] * s[:, None]).sum(-1)
    return np.einsum("mbj,nbj->mnb", q * d[..., None], w).sum(-1)


@pytest.mark.parametrize("rows", [1, 3, 4, 13])         # the 8-, 4- and 1-row kernels, alone and together
@pytest.mark.parametrize("name", NAMES)
def test_q8_matmul_matches_llama_cpp_scheme(name, rows):
    blocks = random_blocks(name, 40, 512, seed=rows)
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    got = qdot.matmul_q8(x, blocks, dtype(name).ggml_id)
    want = llama_cpp_reference(x, blocks, name)
    assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("name", NAMES)
def test_portable_and_vnni_paths_agree_bitwise(name):
    fmt = dtype(name).ggml_id
    blocks = random_blocks(name, 24, 256)
    x = np.random.default_rng(0).standard_normal((13, 256)).astype(np.float32)
    results = []
    for portable in (False, True):
        out = np.empty((13, 24), np.float32)
        qdot.make_matmul(fmt, portable)(blocks, x, out, qdot.TILE_ROWS, qdot.NONE_1D, np.float32(0), qdot.NONE_2D)
        results.append(out)
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("name", NAMES)
def test_norm_and_residual_inside_the_kernel_round_as_the_separate_ops(name):
    """Decode's matmul takes the block's rmsnorm and the residual add into its one call: the result
    must be bit-identical to rmsnorm, then the matmul, then the add."""
    from soma_runtime.backends.cpu.elementwise import rmsnorm
    fmt = dtype(name).ggml_id
    blocks = random_blocks(name, 40, 256, seed=3)
    rng = np.random.default_rng(3)
    x, norm = rng.standard_normal((3, 256)).astype(np.float32), rng.standard_normal(256).astype(np.float32)
    residual = rng.standard_normal((3, 40)).astype(np.float32)
    apart = qdot.matmul_q8(rmsnorm(x, norm, eps=1e-5), blocks, fmt) + residual
    np.testing.assert_array_equal(qdot.matmul_q8(x, blocks, fmt, norm, 1e-5, residual), apart)


def test_decode_matmul_of_no_rows_is_empty():
    """A batch step that wants no logits runs the head on zero rows (the norm folded in)."""
    from soma_runtime.backends import run_op
    from soma_runtime.dtypes import QTensor
    w = QTensor(random_blocks("q8_0", 8, 64), "q8_0", (8, 64))
    got = run_op("matmul", np.zeros((0, 64), np.float32), w, None, None, np.ones(64, np.float32), backend="cpu",
                 transpose_b=True, activations="q8")
    assert got.shape == (0, 8)

"""The CPU convolution's paths (backends/cpu/conv.py) against torch, each forced where the op test's small
cases take it whole: im2col columns (2-D, and a long 1-D sequence) and Winograd tile rows split into several
blocks, a Winograd weight's transform kept while the weight lives and let go with it."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from soma_runtime.backends.cpu import conv as cpu_conv

torch = pytest.importorskip("torch")
F = torch.nn.functional


def tensors(*shapes):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def agree(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("stride,dilation", [(1, 1), (2, 1), (1, 2)])
def test_im2col_columns_built_a_few_output_positions_at_a_time_agree_with_torch(monkeypatch, stride, dilation):
    monkeypatch.setattr(cpu_conv, "COLUMN_BYTES", 4 * 27 * 20)              # 20 positions a block: rows split mid-row
    x, w, b = tensors((2, 3, 25, 13), (5, 3, 3, 3), (5,))
    summed = F.conv2d(*map(torch.from_numpy, (x, w, b)), stride=stride, padding=1, dilation=dilation)
    r = np.random.default_rng(1).standard_normal(summed.shape).astype(np.float32)
    got = cpu_conv.conv(x, w, b, r, stride=stride, padding=1, dilation=dilation, groups=1, epilogue="silu")
    agree(got, F.silu(summed + torch.from_numpy(r)).numpy())


def test_a_long_1d_convolution_in_blocks_of_positions_agrees_with_torch(monkeypatch):
    monkeypatch.setattr(cpu_conv, "COLUMN_BYTES", 4 * 4 * 7 * 300)
    x, w, b = tensors((2, 8, 2000), (6, 4, 7), (6,))
    summed = F.conv1d(*map(torch.from_numpy, (x, w, b)), stride=2, padding=9, dilation=3, groups=2)
    r = np.random.default_rng(1).standard_normal(summed.shape).astype(np.float32)
    got = cpu_conv.conv(x, w, b, r, stride=2, padding=9, dilation=3, groups=2, epilogue="relu")
    agree(got, F.relu(summed + torch.from_numpy(r)).numpy())


def test_winograd_tile_rows_in_several_blocks_agree_with_torch(monkeypatch):
    monkeypatch.setattr(cpu_conv, "TILE_BYTES", 64 * 64 * 9 * 3)               # three tile rows a block, of 12
    x, w, b = tensors((2, 64, 23, 17), (80, 64, 3, 3), (80,))
    r = np.random.default_rng(1).standard_normal((2, 80, 23, 17)).astype(np.float32)
    got = cpu_conv.conv(x, w, b, r, stride=1, padding=1, dilation=1, groups=1, epilogue="relu6")
    want = F.relu6(F.conv2d(*map(torch.from_numpy, (x, w, b)), padding=1) + torch.from_numpy(r)).numpy()
    agree(got, want)


def test_a_winograd_weight_transform_is_made_once_and_let_go_with_its_weight():
    x, w = tensors((1, 64, 8, 8), (64, 64, 3, 3))
    first = cpu_conv.conv(x, w, None, None, stride=1, padding=1, dilation=1, groups=1, epilogue="none")
    kept = cpu_conv.winograd_weights(w)
    assert cpu_conv.winograd_weights(w) is kept
    np.testing.assert_array_equal(cpu_conv.conv(x, w, None, None, stride=1, padding=1, dilation=1, groups=1,
                                                epilogue="none"), first)
    key = id(w)
    del w
    gc.collect()
    assert key not in cpu_conv._transformed

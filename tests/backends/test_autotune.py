"""The autotune table: variants are timed, the winner is recorded on disk, and both variants of a
q8 prefill matmul agree with each other (they differ only in float summation order)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from soma_runtime.backends.cpu import autotune, qmatmul
from soma_runtime.quant import quantize


@pytest.fixture
def table(tmp_path, monkeypatch):
    monkeypatch.setenv("SOMA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_table", None)
    yield tmp_path / "autotune.json"
    autotune._table = None


def test_tune_records_the_fastest_variant_per_shape(table):
    w = quantize(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32), "q4_0")
    measured = qmatmul.tune([w, w])
    key = qmatmul.prefill_key(w)
    assert list(measured) == [key]
    times = measured[key]["seconds"]
    assert set(times) == set(qmatmul.variant_names(w)) >= {"int8", "blas"}
    assert measured[key]["choice"] == min(times, key=times.get)
    assert autotune.choice(key) == measured[key]["choice"]
    on_disk = json.loads(table.read_text())
    assert on_disk[autotune.machine_key()][key] == measured[key]["choice"]
    assert qmatmul.tune([w]) == {}                      # known shapes are not timed again


# q4_1 differs by more: the integer path takes each block's activation sum as f16 (as llama.cpp)
@pytest.mark.parametrize("name,tol", [("q4_0", 1e-5), ("q8_0", 1e-5), ("q4_1", 2e-3)])
def test_prefill_variants_agree(table, name, tol):
    w = quantize(np.random.default_rng(1).standard_normal((48, 128)).astype(np.float32), name)
    results = {variant: run() for variant, run in qmatmul.prefill_variants(w, 16).items()}
    scale = np.abs(results["int8"]).max()
    assert np.abs(results["int8"] - results["blas"]).max() <= tol * scale


def test_a_recorded_blas_choice_is_followed_for_prefill_rows_only(table, monkeypatch):
    """BLAS on dequantized tiles pays only for many rows: a batched decode step keeps the int8 dots."""
    w = quantize(np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32), "q8_0")
    rows = qmatmul.BLAS_MIN_ROWS
    x = np.random.default_rng(3).standard_normal((rows, 64)).astype(np.float32)
    autotune.record({qmatmul.prefill_key(w): "blas"})
    calls = []
    monkeypatch.setattr(qmatmul, "gemm_tiled", lambda *a: calls.append(a) or np.zeros((rows, 32), np.float32))
    qmatmul.matmul_stored(x, w, activations="q8")
    assert calls, "the recorded choice was not used"
    calls.clear()
    assert qmatmul.matmul_stored(x[: rows - 1], w, activations="q8").shape == (rows - 1, 32)
    assert not calls, "a batched decode step went through BLAS"

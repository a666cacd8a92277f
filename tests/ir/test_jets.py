"""Formula hashes, jet lookup, the atoms fallback and verify mode."""
from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest

from soma_runtime.backends import get, run_op
from soma_runtime.errors import JetMismatchError
from soma_runtime.ir.backend import Backend
from soma_runtime.ir.graph import TensorMeta, meta_of
from soma_runtime.ir.jets import REGISTRY
from soma_runtime.ir.ops import OPS
from tests.backends.test_ops import CASES


class Named(Backend):
    """A host backend of another name: only the jets registered under that name are its own."""

    def __init__(self, name):
        self.name = name


def fhash(op, shapes, dtype="f32", **attrs):
    return OPS[op].formula_hash([TensorMeta.of(s, dtype) for s in shapes], attrs)


HASH_SCRIPT = "from soma_runtime.ir.ops import OPS; from soma_runtime.ir.graph import TensorMeta as T; " \
              "print(OPS['rmsnorm'].formula_hash([T.of((2, 8), 'f32'), T.of((8,), 'f32')], {}))"


def test_formula_hash_is_identical_across_processes():
    runs = {subprocess.run([sys.executable, "-c", HASH_SCRIPT], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)}
    assert runs == {fhash("rmsnorm", [(2, 8), (8,)])}


def test_formula_hash_ignores_sizes_and_numeric_params():
    assert fhash("rmsnorm", [(2, 8), (8,)], eps=1e-5) == fhash("rmsnorm", [(7, 3, 64), (64,)], eps=1e-6)
    assert fhash("sdpa", [(1, 8, 5, 16)] * 3, causal=True) == \
        fhash("sdpa", [(2, 4, 1, 64), (2, 2, 9, 64), (2, 2, 9, 64)], causal=True, scale=0.1)


def test_same_formula_gets_the_same_hash_across_op_names():
    # conv1d and conv2d are one formula (windows, multiply, sum); the spatial rank is a parameter
    assert fhash("conv1d", [(1, 2, 8), (3, 2, 3)]) == fhash("conv2d", [(1, 2, 8, 8), (3, 2, 3, 3)])


@pytest.mark.parametrize("a,b", [
    (("add", [(4,), (4,)], {}), ("sub", [(4,), (4,)], {})),
    (("gelu", [(4,)], {"approximate": "none"}), ("gelu", [(4,)], {"approximate": "tanh"})),
    (("matmul", [(2, 4), (4, 3)], {}), ("matmul", [(2, 4), (3, 4)], {"transpose_b": True})),
    (("softmax", [(4, 4)], {}), ("softmax", [(4, 4)], {"causal": True})),
    (("silu", [(4,)], {}), ("sigmoid", [(4,)], {})),
    (("max_pool", [(1, 1, 4, 4)], {}), ("avg_pool", [(1, 1, 4, 4)], {})),
])
def test_different_formulas_get_different_hashes(a, b):
    assert fhash(a[0], a[1], **a[2]) != fhash(b[0], b[1], **b[2])


def test_rope_styles_and_optional_inputs_change_the_hash():
    metas = [TensorMeta.of((1, 2, 2, 8), "f32"), TensorMeta.of((1, 2), "i64"), TensorMeta.of((4,), "f32")]
    assert OPS["rope"].formula_hash(metas, {"style": "neox"}) != OPS["rope"].formula_hash(metas, {"style": "interleaved"})
    x, w = TensorMeta.of((2, 8), "f32"), TensorMeta.of((8,), "f32")
    assert OPS["rmsnorm"].formula_hash([x, w], {}) != OPS["rmsnorm"].formula_hash([x, None], {})


@pytest.mark.parametrize("op,make,ref,dt,attrs", CASES)
def test_every_tested_op_finds_its_cpu_jet(op, make, ref, dt, attrs):
    inputs = OPS[op].pad(make(dt))
    metas = [None if x is None else meta_of(x) for x in inputs]
    kernel = REGISTRY.kernel_for(OPS[op], metas, attrs, get("cpu"))
    assert getattr(kernel, "backend", "cpu") != "reference", f"{op}{[m and m.dtype for m in metas]} fell back to atoms"


def test_a_miss_falls_back_to_atoms_and_logs_once(caplog):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    metas = [meta_of(x)]
    with caplog.at_level(logging.WARNING, logger="soma_runtime.jets"):
        k1 = REGISTRY.kernel_for(OPS["relu"], metas, {}, Named("nowhere"))
        k2 = REGISTRY.kernel_for(OPS["relu"], metas, {}, Named("nowhere"))
    assert k1.backend == k2.backend == "reference"
    assert sum("no nowhere jet for relu" in r.message for r in caplog.records) == 1
    np.testing.assert_array_equal(k1(x - 2), np.maximum(x - 2, 0))


def test_verify_mode_catches_a_broken_jet(monkeypatch):
    REGISTRY.register("silu", "broken-test", [("f32",)], lambda x, out=None: x * 0.5)   # not silu
    monkeypatch.setenv("SOMA_VERIFY", "1")
    x = np.linspace(-3, 3, 12, dtype=np.float32)
    kernel = REGISTRY.kernel_for(OPS["silu"], [meta_of(x)], {}, Named("broken-test"))
    with pytest.raises(JetMismatchError, match="silu"):
        kernel(x)


def test_verify_mode_passes_real_jets(monkeypatch):
    monkeypatch.setenv("SOMA_VERIFY", "1")
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((16,)).astype(np.float32)
    for op, inputs, attrs in [("rmsnorm", (x, w), {}), ("silu", (x,), {}), ("matmul", (x, x), {"transpose_b": True}),
                              ("softmax", (x,), {"causal": True})]:
        run_op(op, *inputs, backend="cpu", **attrs)

"""The all_reduce op on every backend, over a group of two ranks: this process and a helper process
(gloo, started and stopped through its handle). Each rank's result is what torch sums of both ranks'
inputs; the reference backend's atoms (the `ranks` read) and each backend's jet alike."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from soma_runtime.backends import run_op
from soma_runtime.errors import ParallelError
from soma_runtime.ir import collective
from soma_runtime.parallel import free_port
from tests.backends import BACKENDS

DTYPES = {"f32": (np.float32, 1e-6), "f16": (np.float16, 2e-3)}
HELPER = """
import sys
import numpy as np
from soma_runtime.backends import run_op
from soma_runtime.ir import collective
from soma_runtime.errors import ParallelError
collective.join(1, 2, sys.argv[1])
for backend in sys.argv[2].split(","):
    for dtype in (np.float32, np.float16):
        run_op("all_reduce", np.random.default_rng(1).standard_normal((3, 5, 4)).astype(dtype), backend=backend)
collective.leave()
"""


def test_all_reduce_sums_both_ranks_inputs_on_every_backend():
    address = f"127.0.0.1:{free_port()}"
    helper = subprocess.Popen([sys.executable, "-c", HELPER, address, ",".join(BACKENDS)])
    try:
        collective.join(0, 2, address)
        for backend in BACKENDS:
            for name, (dtype, tol) in DTYPES.items():
                mine, theirs = (np.random.default_rng(seed).standard_normal((3, 5, 4)).astype(dtype) for seed in (0, 1))
                got = run_op("all_reduce", mine, backend=backend)
                want = (torch.from_numpy(mine).float() + torch.from_numpy(theirs).float()).numpy()
                assert got.dtype == dtype, (backend, name)
                np.testing.assert_allclose(got.astype(np.float32), want, atol=tol * max(1.0, float(np.abs(want).max())))
    finally:
        collective.leave()
        helper.wait(timeout=60)
    assert helper.returncode == 0


def test_a_collective_outside_a_group_is_a_typed_error():
    with pytest.raises(ParallelError, match="in no tensor-parallel group"):
        run_op("all_reduce", np.ones(3, np.float32), backend="cpu")

"""Every Triton kernel launch of the session (interpreted, without a GPU) also compiles for an H200:
the interpreter runs a kernel's Python, not its compilation (see sm90.py). Runs last: conftest.py
records the launches and orders this test after the others; where they ran in other processes
(`make test`), it reads theirs from SOMA_TEST_LAUNCHES, and runs after them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from soma_runtime.backends import run_op
from tests.cuda.sm90 import LAUNCHES

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="on a GPU every launch compiles for real")


def recorded() -> set[str]:
    """This process's launches and those other test processes left in SOMA_TEST_LAUNCHES."""
    folder, found = os.environ.get("SOMA_TEST_LAUNCHES"), set(LAUNCHES)
    for name in os.listdir(folder) if folder else ():
        with open(os.path.join(folder, name)) as f:
            found.update(json.load(f))
    return found


def test_every_launched_kernel_compiles_for_sm90(tmp_path):
    LAUNCHES.update(recorded())
    if not LAUNCHES:                           # run on its own: the op test's cases launch the kernels
        from tests.backends.test_ops import CASES
        for case in CASES:
            op, make, _, dtype, attrs = case.values
            run_op(op, *make(dtype), backend="cuda", **attrs)
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(sorted(LAUNCHES)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.cuda.sm90", str(path)], env=env, capture_output=True, text=True,
                          timeout=1800, check=False)
    assert done.returncode == 0, done.stderr[-6000:]

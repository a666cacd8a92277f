"""A second start compiles nothing: every numba kernel a run of the bundled model calls is read from the
disk cache the first start wrote. A kernel whose cache key changes from process to process (a closure
holding a function: numba keys on its pickle) recompiles at every start, seconds before the first reply,
and adds an entry to its index each time."""
from __future__ import annotations

import os
import subprocess
import sys


def run_once() -> str:
    env = dict(os.environ, NUMBA_DEBUG_CACHE="1")
    done = subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", "run", "--prompt", "Hi", "--max-tokens", "2",
                           "--seed", "1"], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


def test_a_second_start_reads_every_kernel_from_the_disk_cache():
    run_once()
    saved = sorted({line.split("'")[1].rsplit("/", 1)[-1] for line in run_once().splitlines()
                    if line.startswith("[cache] data saved")})
    assert not saved, f"compiled again in a second process: {saved}"

"""What the comparison benches share: each engine measured in a process of its own, with the thread
count it is given, and figures taken as the median over alternating rounds."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np


def run_worker(script: str, *args: str, threads: int, timeout: int = 3600) -> dict:
    """`script --worker ... --threads N` in a fresh process: the JSON its last line prints, or {"error"}."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, script, "--worker", *args, "--threads", str(threads)],
                       capture_output=True, text=True, env=env, timeout=timeout, check=False)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-2000:]}


def median_of(rounds: list[dict]) -> dict:
    """Each float figure's median over the rounds that have it (the machine's speed drifts between minutes);
    the first error where a round failed."""
    if any("error" in r for r in rounds):
        return next(r for r in rounds if "error" in r)
    keys = [k for k, v in rounds[0].items() if isinstance(v, float) and all(k in r for r in rounds)]
    return {**rounds[0], **{k: float(np.median([r[k] for r in rounds])) for k in keys}, "rounds": rounds}

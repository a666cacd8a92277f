"""Tensor parallel: one decoder run by a group of processes (ir/collective.py), each holding one
rank's shard of its weights and KV cache (architectures/shard.py).

Rank 0 is the process that loads the model: it starts ranks 1..N-1 (`python -m soma_runtime.parallel`),
supervises them and stops them when the model goes. Every rank builds its engine the same way, in
lockstep; then rank 0 schedules, and for each step shares the step's inputs with the others, which run
it on their shards (`Engine.follow`). An all-reduce self-test at start-up fails fast with a clear
error; so does a rank that cannot load its shard. On GPUs each rank has its own (cuda:<rank>), NCCL
between them; on the host, gloo.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np

from soma_runtime import loaders, schedule
from soma_runtime.architectures.shard import shard
from soma_runtime.engine.generate import Engine
from soma_runtime.errors import ParallelError
from soma_runtime.ir import collective
from soma_runtime.ir.backend import Backend, Precision

JOIN_TIMEOUT_S = 120.0         # how long ranks wait for each other in a collective (a follower imports, maps, compiles)
STOP_TIMEOUT_S = 30.0


def sharded_engine(loaded: loaders.LoadedModel, backend: Backend, precision: Precision, n_ctx: int | None,
                   kv_tokens: int | None = None) -> Engine:
    """This rank's engine of `loaded`, built the same way on every rank (collectives meet in order)."""
    group = collective.current()
    cfg, weights, part = shard(loaded.config, loaded.weights, group.rank, group.size)
    return Engine(cfg, weights, loaded.tokenizer, backend, n_ctx, precision.kv_dtype, precision.activations, kv_tokens,
                  shard=part)


def self_test(device: bool) -> None:
    """Every rank sums rank + 1 over the group: ParallelError unless the total is right."""
    group = collective.current()
    want = group.size * (group.size + 1) / 2
    if device:
        import torch
        value = torch.full((1,), group.rank + 1.0, device="cuda")
        collective.summed_(value)
        got = float(value.item())
    else:
        got = float(collective.summed(np.full(1, group.rank + 1.0, np.float32))[0])
    if got != want:
        raise ParallelError(f"rank {group.rank}: the all-reduce self-test summed to {got}, not {want}")


def ready(ok: bool) -> int:
    """How many ranks built their engines (each says whether it did)."""
    return int(collective.summed(np.full(1, 1.0 if ok else 0.0, np.float32))[0])


class Followers:
    """Rank 0's ranks 1..N-1: processes it starts, joins as rank 0, checks, and stops. `spec` is what a
    follower needs to build its engine as rank 0 does (source, backend, precision, context, threads)."""

    def __init__(self, ranks: int, spec: dict):
        self.device = spec["backend"] == "cuda"
        if self.device and ranks > (count := device_count()):
            raise ParallelError(f"tensor parallel over {ranks} GPUs: this machine has {count}")
        address = f"127.0.0.1:{free_port()}"
        self.logs = [tempfile.TemporaryFile() for _ in range(1, ranks)]     # noqa: SIM115  (closed when collected)
        self.processes = [subprocess.Popen([sys.executable, "-m", "soma_runtime.parallel",
                                            json.dumps({**spec, "rank": r, "ranks": ranks, "address": address,
                                                        "timeout_s": JOIN_TIMEOUT_S})],
                                           stdout=log, stderr=subprocess.STDOUT) for r, log in zip(range(1, ranks), self.logs)]
        try:
            collective.join(0, ranks, address, self.device, JOIN_TIMEOUT_S)
            self_test(self.device)
        except ParallelError as e:
            self.stop(kill=True)
            raise ParallelError(f"{e}{self.report()}") from None

    def confirm(self) -> None:
        """After building rank 0's engine: ParallelError (every rank stopped) unless all ranks built theirs."""
        built = ready(True)
        if built != len(self.processes) + 1:
            self.stop(kill=True)
            raise ParallelError(f"{len(self.processes) + 1 - built} tensor-parallel rank(s) could not build the model"
                                f"{self.report()}")

    def abandon(self) -> None:
        """Rank 0 could not build its engine: the others are told so and stopped."""
        ready(False)
        self.stop(kill=True)

    def report(self) -> str:
        """What the followers that failed printed last (their logs are temporary files, gone with this object)."""
        lines = []
        for r, (process, log) in enumerate(zip(self.processes, self.logs), 1):
            if process.poll() not in (None, 0):
                log.seek(0)
                tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
                lines.append(f"rank {r} exited with {process.returncode}: {' | '.join(tail)}")
        return "; " + "; ".join(lines) if lines else ""

    def stop(self, kill: bool = False) -> None:
        """Tell the followers to stop (unless `kill`), leave the group, and end every follower process."""
        if not kill:
            try:
                collective.shared(None)
            except ParallelError:
                kill = True
        collective.leave()
        for process in self.processes:
            try:
                process.wait(timeout=0 if kill else STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def device_count() -> int:
    import torch
    return torch.cuda.device_count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def follow(spec: dict) -> None:
    """A follower's life: join the group, pass the self-test, build its engine, run the steps rank 0 leads,
    leave when told."""
    schedule.use_threads(spec["threads"])
    device = spec["backend"] == "cuda"
    collective.join(spec["rank"], spec["ranks"], spec["address"], device, spec["timeout_s"])
    try:
        self_test(device)
        try:
            loaded = loaders.load(spec["source"])
            engine = sharded_engine(loaded, schedule.backend_named(spec["backend"]),
                                    Precision(spec["kv_dtype"], spec["activations"]), spec["n_ctx"],
                                    spec["kv_tokens"])
        except Exception:
            ready(False)
            raise
        ready(True)
        engine.follow()
    finally:
        collective.leave()


if __name__ == "__main__":
    os.environ.setdefault("SOMA_AUTOTUNE", "0")
    follow(json.loads(sys.argv[1]))

"""Decodings in lockstep: a job is a generator that yields a `Forward` (the decoder step it needs next) and
is sent that step's logits; every waiting job's step runs as rows of one graph run, so several windows
(of one recording or of many) decode as one batch. Knows the runner's forward, nothing of search.
"""
from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

from soma_runtime.engine.transcribe.runner import Hypothesis, WhisperRunner


@dataclass
class Forward:
    """One decoder step a job needs: each hypothesis's new tokens, and the rows (indices into the step's
    tokens) whose logits it wants; None: each hypothesis's last."""
    batch: list[tuple[Hypothesis, list[int]]]
    wanted: list[int] | None = None

    def rows(self) -> np.ndarray:
        if self.wanted is not None:
            return np.asarray(self.wanted, np.int64)
        return np.cumsum([len(tokens) for _, tokens in self.batch]) - 1


Steps = Generator[Any, np.ndarray, Any]


def lockstep(runner: WhisperRunner, jobs: Iterable[Steps], width: int | None = None) -> Iterator[tuple[int, Any]]:
    """Run `jobs`, at most `width` at a time (a finished one lets the next in), their steps batched. Yields
    (job index, item) for whatever a job yields that is not a Forward, and for its return value when it
    has one. Jobs left unfinished (an error, the caller stopping early) are closed, releasing their caches."""
    queue = enumerate(jobs)
    running: dict[int, Steps] = {}
    sends: dict[int, np.ndarray | None] = {}
    try:
        while True:
            for i, job in islice(queue, width - len(running) if width else None):
                running[i], sends[i] = job, None
            if not running:
                return
            asks: dict[int, Forward] = {}
            for i, value in sends.items():
                job = running[i]
                try:
                    item = job.send(value)
                    while not isinstance(item, Forward):
                        yield i, item
                        item = job.send(None)
                    asks[i] = item
                except StopIteration as stop:
                    del running[i]
                    if stop.value is not None:
                        yield i, stop.value
            sends = step(runner, asks) if asks else {}
    finally:
        for job in running.values():
            job.close()


def step(runner: WhisperRunner, asks: dict[int, Forward]) -> dict[int, np.ndarray]:
    """One graph run for every job's step; each job's logits."""
    batch, wanted, counts, base = [], [], [], 0
    for ask in asks.values():
        rows = ask.rows()
        wanted.append(rows + base)
        counts.append(len(rows))
        batch += ask.batch
        base += sum(len(tokens) for _, tokens in ask.batch)
    logits = runner.forward(batch, np.concatenate(wanted).tolist())
    return dict(zip(asks, np.split(logits, np.cumsum(counts)[:-1])))

"""A request the scheduler cannot run, or a step that fails, ends only the requests it holds: each gets
the error, their pages come back, and every later request is served (the loop never spins or dies)."""
from __future__ import annotations

import queue

import pytest

from soma_runtime.engine.generate import batching
from soma_runtime.engine.generate.batching import Scheduler
from soma_runtime.engine.generate.engine import GenerationRequest
from soma_runtime.engine.generate.sampling import SamplingParams
from soma_runtime.errors import RequestError
from tests.engine.test_batching import run_all, solo


def outcome(inbox: queue.Queue, timeout: float = 60):
    """The job's last item: None (finished) or the Exception it ended with."""
    while True:
        item = inbox.get(timeout=timeout)
        if item is None or isinstance(item, Exception):
            return item


@pytest.mark.parametrize("seed", [-5, 2**70, 1.5, True])
def test_a_seed_numpy_rejects_is_refused_when_submitted(smol, seed):
    scheduler = Scheduler(smol.engine)
    try:
        bad = GenerationRequest(smol.tokenize("Hi"), 8, [], SamplingParams(temperature=0.7, seed=seed))   # past the API's checks
        with pytest.raises(RequestError, match="seed"):
            scheduler.submit(bad, print)
    finally:
        scheduler.close()


def test_a_request_that_cannot_start_fails_alone(smol, monkeypatch):
    ids = smol.tokenize("List three colors:")
    expected = solo(smol, ids, 8)
    real = batching.Stream

    def stream(engine, req):
        if req.max_tokens == 7:
            raise ValueError("numpy rejected it")
        return real(engine, req)
    monkeypatch.setattr(batching, "Stream", stream)
    scheduler = Scheduler(smol.engine)
    try:
        inbox = queue.Queue()
        scheduler.submit(smol.request(ids, 7, temperature=0), inbox.put)
        assert str(outcome(inbox)) == "numpy rejected it"
        assert run_all(scheduler, [smol.request(ids, 8, temperature=0)]) == [expected]
    finally:
        scheduler.close()
    assert smol.engine.pool.in_use == 0


def test_a_failing_step_ends_its_requests_and_the_loop_goes_on(smol, monkeypatch):
    ids = smol.tokenize("Once upon a time")
    expected = solo(smol, ids, 6)
    scheduler = Scheduler(smol.engine)
    launch, calls = smol.engine.launch, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return launch(*args, **kwargs)
    monkeypatch.setattr(smol.engine, "launch", failing_once)
    try:
        inbox = queue.Queue()
        scheduler.submit(smol.request(ids, 40, temperature=0), inbox.put)
        assert str(outcome(inbox)) == "device lost"
        assert smol.engine.pool.in_use == 0
        assert run_all(scheduler, [smol.request(ids, 6, temperature=0)]) == [expected]
    finally:
        scheduler.close()


def test_a_receiver_that_fails_ends_its_request_only(smol):
    ids = smol.tokenize("The best way to learn programming is")
    expected = solo(smol, ids, 6)
    scheduler = Scheduler(smol.engine)

    def broken(item):
        raise RuntimeError("event loop is closed")
    try:
        scheduler.submit(smol.request(ids, 50, temperature=0), broken)
        assert run_all(scheduler, [smol.request(ids, 6, temperature=0)]) == [expected]
    finally:
        scheduler.close()
    assert smol.engine.pool.in_use == 0

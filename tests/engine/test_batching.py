"""The continuous-batching scheduler against the same engine run one request at a time: every
request gets exactly its solo tokens however it is batched, chunked or cut short; pages come back."""
from __future__ import annotations

import queue

import pytest

from soma_runtime.engine.generate.batching import Scheduler

PROMPTS = ["The capital of France is", "Write a poem about the moon.", "def fibonacci(n):", "List three colors:",
           "Once upon a time, in a land far far away, there lived a", "1, 2, 3, 4,", "Translate to French: good morning",
           "The best way to learn programming is"]


def solo(model, ids, max_tokens, **params):
    """The request alone through the library's loop."""
    return [t.id for t in model.generate(ids, max_tokens, temperature=0, **params)]


def run_all(scheduler, requests) -> list[list[int]]:
    """Submit every request at once; collect each one's token ids in order."""
    inbox = queue.Queue()
    for i, req in enumerate(requests):
        scheduler.submit(req, lambda item, i=i: inbox.put((i, item)))
    tokens, open_jobs = [[] for _ in requests], len(requests)
    while open_jobs:
        i, item = inbox.get(timeout=120)
        if isinstance(item, Exception):
            raise item
        if item is None:
            open_jobs -= 1
        else:
            tokens[i].append(item.id)
    return tokens


# 7: prompts prefill in chunks beside running decodes; run_ahead: each decode step launched before the
# tokens of the one before it are read (the default on a GPU)
@pytest.mark.parametrize("step_tokens, run_ahead", [(256, False), (7, False), (256, True), (7, True)])
def test_batched_requests_get_their_solo_tokens(smol, step_tokens, run_ahead):
    ids = [smol.tokenize(p) for p in PROMPTS]
    lengths = [5 + 3 * i for i in range(len(PROMPTS))]
    expected = [solo(smol, x, n) for x, n in zip(ids, lengths)]
    scheduler = Scheduler(smol.engine, max_batch=6, step_tokens=step_tokens, run_ahead=run_ahead)
    try:
        got = run_all(scheduler, [smol.request(x, n, temperature=0) for x, n in zip(ids, lengths)])
        assert got == expected
        assert scheduler.stats.max_batch > 1 and scheduler.stats.finished == len(PROMPTS)
        assert (scheduler.stats.ran_ahead > 0) == run_ahead
    finally:
        scheduler.close()
    assert smol.engine.pool.in_use == 0


def test_prefix_cache_serves_a_shared_system_prompt(smol):
    system = "You are a careful assistant. " * 12
    first, second = (smol.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": q}])
                     for q in ("Name a fruit.", "Name a planet."))
    expected = solo(smol, second, 12)
    smol.engine.pool.clear_prefix_cache()
    scheduler = Scheduler(smol.engine)
    try:
        run_all(scheduler, [smol.request(first, 4, temperature=0)])
        assert scheduler.stats.cached_tokens == 0
        assert run_all(scheduler, [smol.request(second, 12, temperature=0)]) == [expected]
        shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
        assert scheduler.stats.cached_tokens == shared // 16 * 16 > 0
    finally:
        scheduler.close()


@pytest.mark.parametrize("run_ahead", [False, True])
def test_cancelled_jobs_free_their_pages_and_others_finish(smol, run_ahead):
    ids = smol.tokenize(PROMPTS[0])
    expected = solo(smol, ids, 20)
    scheduler = Scheduler(smol.engine, run_ahead=run_ahead)
    inbox = queue.Queue()
    try:
        doomed = scheduler.submit(smol.request(smol.tokenize(PROMPTS[4]), 200, temperature=0), lambda item: inbox.put(item))
        assert inbox.get(timeout=60).id >= 0                  # it is running
        doomed.cancel()
        assert run_all(scheduler, [smol.request(ids, 20, temperature=0)]) == [expected]
        assert scheduler.stats.cancelled == 1
    finally:
        scheduler.close()
    assert smol.engine.pool.in_use == 0


@pytest.mark.parametrize("run_ahead", [False, True])
def test_sampled_requests_follow_their_seed(smol, run_ahead):
    ids = smol.tokenize(PROMPTS[3])
    expected = [t.id for t in smol.generate(ids, 16, temperature=0.9, seed=7)]
    scheduler = Scheduler(smol.engine, run_ahead=run_ahead)
    try:
        reqs = [smol.request(ids, 16, temperature=0.9, seed=7),
                smol.request(smol.tokenize(PROMPTS[4]), 16, temperature=0.9, seed=1)]
        assert run_all(scheduler, reqs)[0] == expected
        assert (scheduler.stats.ran_ahead > 0) == run_ahead
    finally:
        scheduler.close()


def test_a_burst_sharing_a_prompt_start_prefills_it_once(smol):
    system = "You are a careful assistant. " * 12
    ids = [smol.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": q}])
           for q in ("Name a fruit.", "Name a planet.", "Name a river.", "Name a bird.")]
    expected = [solo(smol, x, 6) for x in ids]
    smol.engine.pool.clear_prefix_cache()
    scheduler = Scheduler(smol.engine)
    try:
        assert run_all(scheduler, [smol.request(x, 6, temperature=0) for x in ids]) == expected
        shared = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1])) if a != b) // 16 * 16
        assert scheduler.stats.cached_tokens == 3 * shared > 0           # all but the first reuse its pages
    finally:
        scheduler.close()

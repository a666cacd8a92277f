"""Speculative decoding against plain decoding in the same run: every draft kind gives the same greedy
tokens (SmolLM2 and each tiny family), batched beside plain streams; sampling with drafts keeps the
target's distribution (chi-squared against the model's own softmax); rejected drafts give their pages back."""
from __future__ import annotations

import queue

import numpy as np
import pytest
from scipy.stats import chisquare

from soma_runtime.engine.generate.batching import Scheduler
from soma_runtime.engine.generate.sampling import Sampler, SamplingParams
from soma_runtime.engine.generate.speculate import IDLE_STEPS, REST_STEPS, Drafter, DraftLength, PromptLookup, lookup
from soma_runtime.engine.grammar import constraint_of
from soma_runtime.ir.sampling import probabilities
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import FAMILIES, build_model

GROUNDED = ("Summarize: The committee met on Tuesday. The committee approved the budget for the new library. "
            "The new library will open in May. Summary: The committee")
FREE = "Once upon a time, in a land far far away, there lived a"
UNSAMPLED = {"temperature": 0}
T, N_SEEDS = 0.3, 6000              # sampled streams: the distribution at T, over this many seeds


def tokens(model, prompt, n, draft=None, **params):
    model.speculate(draft)
    try:
        return [t.id for t in model.generate(prompt, n, ignore_eos=True, **{**UNSAMPLED, **params})]
    finally:
        model.speculate(None)


class Fixed(Drafter):
    """Always the same drafts (the test's choice of tokens the target must judge)."""

    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def propose(self, histories, counts, keys, variants):
        return [self.drafts[:k] for k in counts]


@pytest.mark.parametrize("draft", ["prompt-lookup", "layers:8", "layers:1", Fixed([28, 28, 28])])
@pytest.mark.parametrize("prompt", [GROUNDED, FREE])
def test_smollm2_greedy_tokens_are_plain_decodings(smol, draft, prompt):
    plain = tokens(smol, prompt, 40)
    assert tokens(smol, prompt, 40, draft) == plain
    m = smol.metrics()
    assert m["target_steps"] > 0
    assert m["drafted_tokens"] > 0 or (draft == "prompt-lookup" and prompt == FREE)   # free text may offer no n-gram
    assert m["tokens_per_step"] == pytest.approx(1 + m["accepted_tokens"] / m["target_steps"])
    assert smol.engine.pool.in_use == 0


def test_prompt_lookup_accepts_input_grounded_text(smol):
    tokens(smol, GROUNDED, 40, "prompt-lookup")
    m = smol.metrics()
    assert m["acceptance_rate"] > 0.3 and m["tokens_per_step"] > 1.3, m


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(request.param))
    build_model(request.param, directory)
    return Runtime().load(directory, progress=False)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A different random model on the same tokenizer: a draft model that is often wrong."""
    directory = str(tmp_path_factory.mktemp("draft"))
    build_model("qwen2", directory, seed=7, num_hidden_layers=1)
    return Runtime().load(directory, progress=False)


def test_tiny_families_greedy_tokens_are_plain_decodings(family, other_draft):
    prompt = family.tokenize("The quick brown fox jumps over the lazy dog. The quick brown")
    plain = tokens(family, prompt, 48)
    for draft in ("prompt-lookup", "layers:1", other_draft):
        assert tokens(family, prompt, 48, draft) == plain, draft
        assert family.metrics()["drafted_tokens"] > 0
    assert family.engine.pool.in_use == 0 and other_draft.engine.pool.in_use == 0


def run_together(model, scheduler: Scheduler, prompts: list[str], asks: list[dict], n: int) -> list[list[int]]:
    """Every request submitted at once to `scheduler`; each one's token ids."""
    inbox, got = queue.Queue(), [[] for _ in prompts]
    try:
        for i, (p, a) in enumerate(zip(prompts, asks)):
            constraint = constraint_of(regex=a["regex"]) if "regex" in a else None
            logprobs = {"logprobs": a["logprobs"]} if "logprobs" in a else {}
            scheduler.submit(model.request(model.tokenize(p), n, temperature=0, constraint=constraint, **logprobs),
                             lambda item, i=i: inbox.put((i, item)))
        done = 0
        while done < len(prompts):
            i, item = inbox.get(timeout=120)
            assert not isinstance(item, Exception), item
            done += item is None
            if item is not None:
                got[i].append(item.id)
    finally:
        scheduler.close()
    assert model.engine.pool.in_use == 0
    return got


def test_speculative_and_plain_streams_share_batches(smol):
    """Streams that speculate beside ones that cannot (a grammar's, one asking logprobs) each get their
    tokens alone, in steps that hold several of them."""
    prompts = [GROUNDED, FREE, "def fibonacci(n):", "List three colors:"]
    asks = [{}, {}, {"logprobs": 2}, {"regex": "(red|green|blue), (red|green|blue)"}]
    want = [[t.id for t in smol.generate(p, 24, temperature=0, **a)] for p, a in zip(prompts, asks)]
    scheduler = Scheduler(smol.engine, max_batch=4, step_tokens=256, thread=True, drafter=PromptLookup())
    assert run_together(smol, scheduler, prompts, asks, 24) == want
    assert scheduler.stats.max_batch > 1 and scheduler.stats.drafted_tokens > 0


def test_resting_speculators_run_ahead(smol):
    """Streams whose drafts keep failing rest; their plain steps are launched ahead (as on a GPU), and every
    token is still the one plain decoding gives."""
    prompts = [FREE, "def fibonacci(n):"]
    want = [[t.id for t in smol.generate(p, 40, temperature=0)] for p in prompts]
    scheduler = Scheduler(smol.engine, max_batch=2, step_tokens=256, run_ahead=True, thread=True, drafter=Fixed([28] * 4))
    assert run_together(smol, scheduler, prompts, [{}, {}], 40) == want
    assert scheduler.stats.drafted_tokens > 0 and scheduler.stats.ran_ahead > 0


def test_sampling_a_draft_keeps_the_distribution():
    """Sampler.verify, over many draws, against the distribution it must keep (a draft likely, unlikely,
    and filtered out by top-k)."""
    logits = np.random.default_rng(0).normal(0, 1.5, 64)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.97, min_p=0.0, seed=1)
    ids, probs = probabilities(logits, [0.9, 20, 0.97, 0.0, 0.0])
    want = np.zeros(64)
    want[ids] = probs
    for draft in (int(ids[np.argmax(probs)]), int(ids[np.argmin(probs)]), int(np.argmin(logits))):
        sampler = Sampler(params)
        counts = np.bincount([sampler.verify(logits, draft, []) for _ in range(20000)], minlength=64)
        kept = want > 0                               # top-k and top-p leave the rest never drawn
        assert not counts[~kept].any(), draft
        assert chisquare(counts[kept], want[kept] * counts.sum()).pvalue > 1e-3, draft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    build_model("llama", directory)
    return Runtime().load(directory, progress=False)


def test_speculative_sampling_keeps_the_models_distribution(tiny):
    """Sampled streams over many seeds with fixed drafts [a, b]: the second token (checked against draft a)
    and the third where the second was a (checked against b), each against the model's own distribution
    there, summed over the first token (drawn at the prompt's end, without drafts)."""
    prompt = tiny.tokenize("Hello world, this is")
    vocab = tiny.engine.cfg.vocab_size

    def dist(tokens_before) -> np.ndarray:                 # the model's distribution at temperature T
        logits = tiny.logits(tokens_before)[-1].astype(np.float64) / T
        p = np.exp(logits - logits.max())
        return p / p.sum()
    p1 = dist(prompt)
    p2 = np.stack([dist(prompt + [t]) for t in range(vocab)])          # [first, second]
    second = p1 @ p2
    a = int(np.argmax(second * (1 - second)))      # a draft kept about as often as it is not
    with_a = p1 * p2[:, a]
    p3 = np.stack([dist(prompt + [t, a]) for t in range(vocab)])
    third = with_a @ p3 / with_a.sum()
    b = int(np.argmax(third * (1 - third)))
    tiny.speculate(Fixed([a, b]))
    try:
        runs = np.asarray([[t.id for t in tiny.generate(prompt, 4, ignore_eos=True, seed=s, temperature=T, top_k=0,
                                                        top_p=1.0, min_p=0.0)] for s in range(N_SEEDS)])
    finally:
        tiny.speculate(None)
    assert tiny.metrics()["drafted_tokens"] >= 2
    for seen, p in ((runs[:, 1], second), (runs[runs[:, 1] == a, 2], third)):
        assert len(seen) >= 200
        common = p * len(seen) >= 5                  # chi-squared needs 5 expected per cell: the rest pooled
        observed = np.append(np.bincount(seen, minlength=len(p))[common], np.sum(~common[seen]))
        expected = np.append(p[common], p[~common].sum()) * len(seen)
        assert chisquare(observed, expected).pvalue > 1e-3


def test_lookup_continues_the_latest_occurrence_of_the_longest_ngram():
    h = np.asarray([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert lookup(h, 3, (3, 2)) == [7, 8, 5]        # no earlier "5 2 3"; the latest earlier "2 3" is followed by 7 8 5
    assert lookup(np.asarray([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]), 2, (3, 2)) == [9, 5]   # "1 2 3" before "2 3"
    assert lookup(np.asarray([4, 5, 6, 5]), 2, (3, 2)) == []                            # a lone "5" is not enough


def test_draft_length_grows_backs_off_and_rests_longer_each_poor_spell():
    length = DraftLength()
    length.update(4, 4)
    assert length.next() == 5
    for rest in (REST_STEPS, 2 * REST_STEPS):
        while not length.resting:
            length.update(length.tokens, 0)
        assert [length.next() for _ in range(rest)] == [0] * rest and length.next() == 1
    length.update(1, 1)
    assert length.rest == REST_STEPS
    for _ in range(IDLE_STEPS):                # nothing to draft, step after step: a rest too
        assert length.next() > 0
        length.nothing_found()
    for rest in (REST_STEPS, 2 * REST_STEPS, 4 * REST_STEPS):     # then one empty look each time, rests doubling
        assert [length.next() for _ in range(rest)] == [0] * rest and length.next() > 0
        length.nothing_found()
    assert [length.next() for _ in range(8 * REST_STEPS)] == [0] * 8 * REST_STEPS and length.next() > 0
    length.update(2, 2)                        # drafts found and kept: looking every step again, rests short
    assert not length.resting and length.rest == REST_STEPS and length.empty == 0

"""Each sampling stage on crafted logits, in SPEC order, the pipeline's determinism, and the same
choices made where the model runs."""
from __future__ import annotations

import numpy as np
import pytest

from soma_runtime.engine.generate.sampling import Sampler, SamplingParams, apply_repeat_penalty
from soma_runtime.errors import RequestError
from soma_runtime.ir.sampling import min_p_filter, softmax, top_k_filter, top_p_filter

NEG = -np.inf


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    out = apply_repeat_penalty(np.array([2.0, -2.0, 1.0, 3.0]), [0, 1, 1], 2.0)
    np.testing.assert_array_equal(out, [1.0, -4.0, 1.0, 3.0])


def test_top_k_keeps_the_k_largest():
    np.testing.assert_array_equal(top_k_filter(np.array([1.0, 5.0, 3.0, 4.0]), 2), [NEG, 5.0, NEG, 4.0])
    np.testing.assert_array_equal(top_k_filter(np.array([1.0, 2.0]), 0), [1.0, 2.0])   # 0 = off


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert np.isfinite(top_p_filter(logits, 0.75)).tolist() == [True, True, False, False]
    assert np.isfinite(top_p_filter(logits, 0.79)).tolist() == [True, True, False, False]
    assert np.isfinite(top_p_filter(logits, 0.81)).tolist() == [True, True, True, False]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = np.log(np.array([0.6, 0.3, 0.07, 0.03]))
    assert np.isfinite(min_p_filter(logits, 0.1)).tolist() == [True, True, True, False]


def test_temperature_zero_is_greedy_after_the_penalty():
    sampler = Sampler(SamplingParams(temperature=0, repeat_penalty=4.0))
    assert sampler(np.array([4.0, 3.0, 0.0]), history=[0]) == 1


def test_temperature_sharpens_and_flattens():
    logits = np.array([2.0, 1.0, 0.0])
    assert softmax(logits / 0.5)[0] > softmax(logits)[0] > softmax(logits / 2.0)[0]


def test_seeded_sampling_is_reproducible_and_respects_the_filters():
    logits = np.array([3.0, 2.9, 0.0, -1.0])
    params = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=123)
    draws = [Sampler(params)(logits, []) for _ in range(3)]
    assert len(set(draws)) == 1
    sampler = Sampler(params)
    seen = {sampler(logits, []) for _ in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"min_p": 2}, {"top_k": -1},
                                 {"repeat_penalty": 0}])
def test_out_of_range_parameters_are_rejected(bad):
    with pytest.raises(RequestError):
        Sampler(SamplingParams(**bad))


def test_draws_over_top_k_survivors_match_draws_over_the_whole_vocabulary():
    """The pipeline runs top-p, min-p and the draw over top-k's survivors only: seeded, it must choose
    what the stages applied to the whole vocabulary, then numpy's choice over all of it, choose."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        logits = rng.standard_normal(5000) * 3
        params = SamplingParams(temperature=0.7, top_k=int(rng.integers(1, 60)), top_p=0.9, min_p=0.05, seed=trial)
        full = min_p_filter(top_p_filter(top_k_filter(logits / 0.7, params.top_k), 0.9), 0.05)
        want = int(np.random.default_rng(trial).choice(full.size, p=softmax(full)))
        assert Sampler(params)(logits, []) == want


def test_the_model_samples_streams_whose_choice_needs_only_its_candidates():
    assert SamplingParams().fits(64) and SamplingParams(temperature=0, top_k=0).fits(64)
    assert SamplingParams(top_k=64).fits(64) and not SamplingParams(top_k=65).fits(64)
    assert not SamplingParams(top_k=0).fits(64)                      # the whole vocabulary: on the host
    assert not SamplingParams(temperature=0, repeat_penalty=1.1).fits(64)
    assert not SamplingParams(presence_penalty=0.5).fits(64)


def test_sampled_on_the_model_as_on_the_host(smol):
    """The decoder graph's `sample` op and the host sampler (taken when logprobs are asked for) share
    `choose` and one uniform per token: a seeded stream gives the same tokens either way."""
    for params in ({"temperature": 0.9, "top_k": 40, "seed": 3}, {"temperature": 1.5, "top_k": 8, "top_p": 0.8, "seed": 4},
                   {"temperature": 0.7, "min_p": 0.2, "seed": 5}):
        on_model = list(smol.generate("Once upon a time", max_tokens=12, **params))
        on_host = list(smol.generate("Once upon a time", max_tokens=12, logprobs=0, **params))
        assert [t.id for t in on_model] == [t.id for t in on_host]
        assert on_host[0].logprob is not None and on_model[0].logprob is None

"""The repetition penalty as its two references define it: llama.cpp's `repeat_penalty` over the last
`repeat_last_n` tokens of prompt and reply (its server and CLI feed the prompt to the sampler), on the
bundled SmolLM2; transformers' `repetition_penalty` over the whole sequence (`repeat_last_n=-1`), on a
tiny random llama. Greedy tokens agree with each, the penalty on; presets fill in what a call leaves out."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from soma_runtime.engine.generate import PRESETS, SamplingParams
from soma_runtime.engine.generate.sampling import Sampler, repeat_window
from soma_runtime.errors import RequestError
from soma_runtime.loaders import default_model_path
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model
from tests.llm.llama_reference import FLOOR

PROMPTS = ["1, 2, 1, 2, 1, 2,", "The cat sat on the mat. The cat sat on the mat. The cat"]
STEPS = 40


@pytest.fixture(scope="module")
def llama():
    from llama_cpp import Llama
    return Llama(model_path=default_model_path(), n_ctx=512, n_threads=2, verbose=False, logits_all=True)


def llama_penalized_greedy(llama, ids: list[int], penalty: float, last_n: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy tokens through its own penalties sampler, the prompt accepted into it first (as
    llama-server does), and its raw logits at each step."""
    from llama_cpp import _internals
    llama.reset()
    sampler = _internals.LlamaSampler()
    sampler.add_penalties(n_vocab=llama.n_vocab(), penalty_last_n=last_n, penalty_repeat=penalty,
                          penalty_freq=0.0, penalty_present=0.0)
    sampler.add_greedy()
    for t in ids:
        sampler.accept(t)
    llama.eval(ids)
    tokens = []
    for _ in range(STEPS):
        tokens.append(sampler.sample(llama._ctx, -1))       # llama_sampler_sample accepts the token it returns
        llama.eval(tokens[-1:])
    rows = np.array(llama.scores[len(ids) - 1: len(ids) + STEPS - 1])
    sampler.close()
    return tokens, rows


def test_the_window_is_llamas_repeat_last_n():
    history = [5, 6, 7, 8]
    assert repeat_window(history, 2) == [7, 8]
    assert repeat_window(history, 64) == history
    assert repeat_window(history, 0) == []            # llama.cpp: 0 disables the penalty
    assert repeat_window(history, -1) == history      # llama.cpp: -1, the whole context
    with pytest.raises(RequestError, match="repeat_last_n"):
        SamplingParams(repeat_last_n=-2).validate()


@pytest.mark.parametrize("penalty", [1.3, 1.8])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_penalized_greedy_choices_are_llama_cpps(smol, llama, prompt, penalty):
    """Each step of llama.cpp's penalized greedy run: our logits, penalized by our sampler over the same
    history, choose llama.cpp's token, except where llama.cpp's own penalized top-2 gap is a near-tie of
    the quantized model's rounding (FLOOR, as for unpenalized greedy). Then our own run, through generate,
    follows llama.cpp's up to the first such tie."""
    ids = smol.prompt_ids(prompt)
    want, theirs = llama_penalized_greedy(llama, ids, penalty, 64)
    ours = smol.logits(ids + want)[len(ids) - 1: len(ids) + STEPS - 1]
    sampler = Sampler(smol.sampling(temperature=0, repeat_penalty=penalty))
    for step, token in enumerate(want):
        history = ids + want[:step]
        chosen = sampler(ours[step], history)
        if chosen != token:
            penalized = sampler.penalize(np.asarray(theirs[step], np.float64), history, [])
            gap = penalized[token] - penalized[chosen]
            assert gap < FLOOR, f"step {step}: we choose {chosen}, llama.cpp {token} by a clear {gap:.3f}"
    got = [t.id for t in smol.generate(ids, max_tokens=STEPS, temperature=0, repetition_penalty=penalty, ignore_eos=True)]
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is not None:
        history = ids + want[:first]
        penalized = sampler.penalize(np.asarray(theirs[first], np.float64), history, [])
        assert penalized[want[first]] - penalized[got[first]] < FLOOR, f"generate parts from llama.cpp at {first}"
    unpenalized = [t.id for t in smol.generate(ids, max_tokens=STEPS, temperature=0, ignore_eos=True)]
    assert got != unpenalized, "the penalty changed nothing"


def test_whole_sequence_penalty_is_transformers(tmp_path):
    from transformers import RepetitionPenaltyLogitsProcessor
    hf_model, tok = build_model("llama", str(tmp_path))
    ours = Runtime().load(str(tmp_path), progress=False)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Hello world 123!").ids
    processor, sequence, clear = RepetitionPenaltyLogitsProcessor(1.5), torch.tensor([ids]), STEPS
    with torch.no_grad():
        for step in range(STEPS):
            scores = processor(sequence, hf_model(sequence).logits[:, -1])
            top2 = torch.topk(scores[0], 2).values
            clear = min(clear, step) if float(top2[0] - top2[1]) < 1e-3 else clear
            sequence = torch.cat([sequence, scores.argmax(-1, keepdim=True)], 1)
    want = sequence[0, len(ids):].tolist()
    got = [t.id for t in ours.generate(ids, max_tokens=STEPS, temperature=0, repetition_penalty=1.5, repeat_last_n=-1,
                                       ignore_eos=True)]
    plain = [t.id for t in ours.generate(ids, max_tokens=STEPS, temperature=0, ignore_eos=True)]
    assert clear >= 16, f"the random model has a near-tie at step {clear}"
    assert got[:clear] == want[:clear]
    assert got[:clear] != plain[:clear], "the penalty changed nothing"


def test_a_preset_fills_in_what_the_call_leaves_out(smol):
    creative = smol.sampling(preset="creative")
    assert (creative.temperature, creative.top_p, creative.min_p, creative.repeat_penalty) == (1.0, 0.95, 0.05, 1.2)
    assert smol.sampling(preset="router").seed == 42 and smol.sampling(preset="code").top_p == 0.5
    assert smol.sampling(preset="creative", temperature=0.3, repetition_penalty=1.0).temperature == 0.3
    assert smol.sampling(preset="creative", repetition_penalty=1.0).repeat_penalty == 1.0
    for name, values in PRESETS.items():
        chosen = smol.sampling(preset=name)
        assert all(getattr(chosen, k) == v for k, v in values.items()), name
    with pytest.raises(RequestError, match="preset"):
        smol.sampling(preset="fast")
    with pytest.raises(RequestError, match="repetition_penalty and repeat_penalty"):
        smol.sampling(repetition_penalty=1.1, repeat_penalty=1.2)
    prompt = "Write a short poem about the sea."
    assert smol.complete(prompt, max_tokens=12, preset="code") == smol.complete(prompt, max_tokens=12, temperature=0,
                                                                                 top_p=0.5, seed=42)

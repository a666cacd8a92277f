"""The bundled SmolLM2-135M-Instruct GGUF against HF transformers and llama.cpp, in the same run."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from soma_runtime.loaders import default_model_path
from soma_runtime.tasks import Runtime
from tests.llm.llama_reference import check_greedy, llama_greedy, near_tie

TEXT = ("The history of astronomy is a long story. Ancient people watched the sky, named the stars, and used "
        "the motion of the Sun and Moon to keep time. Later, telescopes revealed moons around Jupiter and the "
        "phases of Venus, which changed how we see our place in the universe. Today, space telescopes study "
        "distant galaxies and the light left over from the early universe.")
QUESTIONS = ["What is 2+2?", "Explain photosynthesis in two sentences.", "Why is the sky blue?",
             "Name three primary colors.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def path():
    return default_model_path()


@pytest.fixture(scope="module")
def exact(path):
    return Runtime().load(path, kv_dtype="f32", activations="f32", progress=False)


@pytest.fixture(scope="module")
def default(path):
    return Runtime().load(path, progress=False)


@pytest.fixture(scope="module")
def llama(path):
    from llama_cpp import Llama
    return Llama(model_path=path, n_ctx=1024, n_threads=2, verbose=False, logits_all=True)


def test_exact_logits_match_hf_transformers_on_the_same_gguf(path, exact):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    ids = exact.tokenize(TEXT)[:64]
    assert len(ids) == 64
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    got = exact.logits(ids)
    assert (got.argmax(-1) == want.argmax(-1)).all(), "top-1 differs from HF at some position"
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_greedy_chat_matches_llama_cpp(default, llama):
    prompts = [default.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    ids = [default.tokenizer.hf.encode(p, add_special_tokens=False).ids for p in prompts]
    assert [llama.tokenize(p.encode(), add_bos=False, special=True) for p in prompts] == ids
    wanted = [llama_greedy(llama, prompt, 64) for prompt in ids]
    tie = near_tie(wanted)
    ours = [[t.id for t in default.generate(prompt, max_tokens=len(want.tokens), temperature=0)]
            for prompt, want in zip(ids, wanted)]
    matched = [check_greedy(repr(q), got, want, tie) for q, got, want in zip(QUESTIONS, ours, wanted)]
    assert sum(matched) >= 48, f"too few tokens compared ({matched}); pick better-conditioned prompts"


def test_gguf_tokenizer_matches_hf_and_llama_cpp(path, default, llama):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    texts = [TEXT, "Hello, world! 12345 + 678 = 13023", "Caf\u00e9 na\u00efve \u00fcber \u00e9t\u00e9",
             "\u041f\u0440\u0438\u0432\u0435\u0442, \u043a\u0430\u043a \u0434\u0435\u043b\u0430?",
             "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002",
             "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
             "emoji \U0001F600\U0001F680 and tabs\tand\nnewlines  double  spaces", "<|im_start|>user\nhi<|im_end|>\n",
             "def f(x):\n    return x ** 2  # code"]
    for text in texts:
        ours = default.tokenizer.encode(text)
        assert ours == hf.encode(text, add_special_tokens=False), text
        assert ours == llama.tokenize(text.encode(), add_bos=False, special=True), text
        assert default.tokenizer.decode(ours, skip_special=False) == text


def test_chat_template_matches_transformers(path, default):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]):
        for gen in (True, False):
            assert default.chat_prompt(messages, add_generation_prompt=gen) == \
                hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def test_streamed_text_equals_the_decoded_tokens(default):
    tokens = list(default.generate("Once upon a time", max_tokens=24, temperature=0))
    assert "".join(t.text for t in tokens) == default.detokenize([t.id for t in tokens])


def test_seeded_sampling_repeats(default):
    def run():
        return default.complete("The weather today is", max_tokens=16, temperature=0.9, seed=7)
    assert run() == run()

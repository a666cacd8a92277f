"""The official `openai` client against the server: the same greedy text as the Python API,
streaming and not, with usage counts, finish reasons, stops, logprobs and n choices."""
from __future__ import annotations

import numpy as np
import openai
import pytest

from soma_runtime.ir.sampling import log_softmax

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_default_model(client):
    assert [m.id for m in client.models.list().data] == ["default"]


def test_chat_completion_matches_the_python_api(client, smol):
    tokens = list(smol.chat(QUESTION, max_tokens=40, temperature=0))
    r = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == "".join(t.text for t in tokens)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == tokens[-1].finish_reason
    assert r.usage.prompt_tokens == len(smol.chat_ids(QUESTION))
    assert r.usage.completion_tokens == len(tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_matches_the_python_api(client, smol):
    expected = smol.chat(QUESTION, stream=False, max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(model="default", messages=QUESTION, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == sum(1 for c in chunks[1:] if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_with_stop_and_length(client, smol, stream):
    prompt = "The three primary colors are"
    expected = smol.complete(prompt, max_tokens=30, temperature=0, stop=[":"])
    r = client.completions.create(model="default", prompt=prompt, max_tokens=30, temperature=0, stop=[":"], stream=stream)
    chunks = list(r) if stream else [r]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    short = client.completions.create(model="default", prompt=prompt, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_logprobs_are_the_models_log_softmax(client, smol):
    r = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=2, temperature=0, logprobs=True,
                                       top_logprobs=3)
    first = r.choices[0].logprobs.content[0]
    reference = log_softmax(smol.logits(smol.chat_ids(QUESTION))[-1])
    top = np.argsort(-reference)[:3]
    assert first.logprob == pytest.approx(reference[top[0]], abs=1e-4)
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(reference[top].tolist(), abs=1e-4)
    assert [t.token for t in first.top_logprobs] == [smol.detokenize([int(i)]) for i in top]
    legacy = client.completions.create(model="default", prompt="Hello", max_tokens=2, temperature=0, logprobs=2)
    assert len(legacy.choices[0].logprobs.tokens) == 2 and len(legacy.choices[0].logprobs.top_logprobs[0]) == 2


def test_n_choices_follow_the_seed(client):
    def ask():
        r = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=12, temperature=1.0, seed=5, n=3)
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    first = ask()
    assert len(first) == 3 and ask() == first
    assert len(set(first)) > 1


def test_penalties_change_sampling_and_are_checked(client, smol):
    plain = client.completions.create(model="default", prompt="1, 2, 1, 2, 1, 2,", max_tokens=16, temperature=0)
    penalized = client.completions.create(model="default", prompt="1, 2, 1, 2, 1, 2,", max_tokens=16, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0)
    assert plain.choices[0].text == smol.complete("1, 2, 1, 2, 1, 2,", max_tokens=16, temperature=0)
    assert penalized.choices[0].text == smol.complete("1, 2, 1, 2, 1, 2,", max_tokens=16, temperature=0,
                                                      frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized.choices[0].text != plain.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="x", max_tokens=4, presence_penalty=3.0)

"""Sampling fields through the official `openai` client: `repetition_penalty` (and llama.cpp's
`repeat_penalty`, `repeat_last_n`) change the tokens as in the Python API, SPEC's presets apply with a
request's own values over them, a field the server would not act on is a 400 naming it, and the
bookkeeping fields clients send are still accepted."""
from __future__ import annotations

import openai
import pytest

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"
QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def complete(client, **fields) -> str:
    extra = {k: fields.pop(k) for k in list(fields) if k in ("repetition_penalty", "repeat_penalty", "repeat_last_n",
                                                             "preset", "top_k", "min_p")}
    reply = client.completions.create(model="default", prompt=PROMPT, max_tokens=24, extra_body=extra, **fields)
    return reply.choices[0].text


def test_repetition_penalty_is_honoured(client, smol):
    plain = complete(client, temperature=0)
    penalized = complete(client, temperature=0, repetition_penalty=1.3)
    assert penalized == smol.complete(PROMPT, max_tokens=24, temperature=0, repetition_penalty=1.3)
    assert plain == smol.complete(PROMPT, max_tokens=24, temperature=0)
    assert penalized != plain
    assert complete(client, temperature=0, repeat_penalty=1.3) == penalized          # llama.cpp's name
    assert complete(client, temperature=0, repetition_penalty=1.3, repeat_last_n=0) == plain    # an empty window


def test_chat_repetition_penalty_streams_what_the_python_api_gives(client, smol):
    chunks = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=24, temperature=0, stream=True,
                                            extra_body={"repetition_penalty": 1.5})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == smol.chat(QUESTION, stream=False, max_tokens=24, temperature=0, repetition_penalty=1.5)


def test_a_preset_applies_and_the_requests_values_override_it(client, smol):
    assert complete(client, preset="creative", seed=7) == smol.complete(PROMPT, max_tokens=24, preset="creative", seed=7)
    assert complete(client, preset="code") == smol.complete(PROMPT, max_tokens=24, temperature=0, top_p=0.5, seed=42)
    overridden = complete(client, preset="creative", temperature=0)
    assert overridden == smol.complete(PROMPT, max_tokens=24, temperature=0, repetition_penalty=1.2)
    with pytest.raises(openai.BadRequestError, match="preset"):
        complete(client, preset="fast")


@pytest.mark.parametrize("field, value", [("typical_p", 0.5), ("mirostat", 2), ("tfs_z", 0.9), ("penalty_repeat", 1.2)])
def test_an_unknown_sampling_field_is_a_400_naming_it(client, field, value):
    for create in (lambda: client.completions.create(model="default", prompt="x", max_tokens=2, extra_body={field: value}),
                   lambda: client.chat.completions.create(model="default", messages=QUESTION, max_tokens=2,
                                                          extra_body={field: value})):
        with pytest.raises(openai.BadRequestError) as e:
            create()
        assert e.value.status_code == 400 and field in e.value.message and "unknown field" in e.value.message


def test_both_names_of_the_penalty_or_a_logit_bias_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="repetition_penalty and repeat_penalty"):
        complete(client, repetition_penalty=1.2, repeat_penalty=1.1)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="default", prompt="x", max_tokens=2, logit_bias={"42": 5})


def test_the_fields_clients_send_are_still_accepted(client, smol):
    reply = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=8, temperature=0, user="someone",
                                           metadata={"app": "test"}, store=False, logit_bias={}, n=1, top_p=1.0,
                                           presence_penalty=0.0, frequency_penalty=0.0, seed=1, stop=["\n\n"],
                                           stream_options=None, parallel_tool_calls=True, service_tier="auto")
    assert reply.choices[0].message.content == smol.chat(QUESTION, stream=False, max_tokens=8, temperature=0, stop=["\n\n"])

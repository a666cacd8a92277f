"""A second request with the same long system prompt reuses its cached KV pages: it reports the
cached prompt tokens, its first token comes sooner, and its text is what it is without the cache."""
from __future__ import annotations

import time

import openai

SYSTEM = ("You are the reference desk of a maritime museum. Answer questions about ships, navigation, harbours, "
          "lighthouses and the people who worked at sea. Be precise, cite the century when you can, and keep each "
          "answer to two sentences. ") * 6


def test_shared_system_prompt_is_prefilled_once(server, smol):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    def ask(question):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        start, first, text, usage = time.perf_counter(), None, "", None
        for chunk in client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - start
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            usage = chunk.usage or usage
        return text, first, usage, smol.chat(messages, stream=False, max_tokens=12, temperature=0)

    text, cold, usage, expected = ask("Who built the first lighthouse?")
    assert text == expected and usage.prompt_tokens > 300
    text, warm, usage, expected = ask("What is a sextant for?")
    assert text == expected
    assert usage.prompt_tokens_details.cached_tokens >= 288
    assert warm < cold

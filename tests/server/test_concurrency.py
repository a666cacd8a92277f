"""16 streaming clients at once, each with its own prompt and length: every one gets exactly the
text it gets alone, and the server ran them as one batch (its metrics say so)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

TOPICS = ["the sea", "a cat", "mountains", "coffee", "the moon", "rain", "a library", "trains", "autumn", "bees",
          "a lighthouse", "snow", "bread", "the desert", "a violin", "clocks"]


def test_sixteen_streams_get_their_solo_text(server, smol):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    asks = [([{"role": "user", "content": f"Write one sentence about {topic}."}], 8 + 3 * i) for i, topic in enumerate(TOPICS)]
    expected = [smol.chat(messages, stream=False, max_tokens=n, temperature=0) for messages, n in asks]

    def stream(ask):
        messages, n = ask
        chunks = client.chat.completions.create(model="default", messages=messages, max_tokens=n, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(stream, asks))
    assert got == expected
    assert server.metric("soma_batch_size_max") > 1
    assert server.metric("soma_kv_pages_in_use") == 0

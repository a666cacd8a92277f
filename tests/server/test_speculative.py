"""A server started with --draft prompt-lookup: concurrent completions through the openai client get the
tokens plain decoding gives alone, and /v1/metrics counts the drafts proposed and kept."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

from tests.server.conftest import ServerProcess

ARTICLE = ("The council met on Tuesday. The council approved the budget for the new library. The new library will "
           "open in May on Main Street. The new library will have a reading hall and a computer lab.")


def test_a_speculating_server_answers_as_plain_decoding(smol):
    questions = [f"{ARTICLE}\n\nRepeat the text above word for word.", "Name three colors.",
                 f"{ARTICLE}\n\nWhat will the new library have?"]
    want = [smol.chat([{"role": "user", "content": q}], stream=False, max_tokens=40, temperature=0) for q in questions]
    server = ServerProcess("--draft", "prompt-lookup", "--max-batch", "4")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        def ask(question: str) -> str:
            reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                                   max_tokens=40, temperature=0)
            return reply.choices[0].message.content
        with ThreadPoolExecutor(len(questions)) as pool:
            assert list(pool.map(ask, questions)) == want
        drafted, kept = server.metric("soma_draft_tokens_total"), server.metric("soma_draft_tokens_accepted_total")
        assert drafted > 0 and 0 < kept <= drafted
    finally:
        assert server.stop() == 0, server.output()

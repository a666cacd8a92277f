"""Server sessions: a chat request naming a `session` is a turn of a conversation the server keeps (its
context renders the prompt, the reply joins it), and /v1/context/* shows, counts, budgets, clears, saves
and loads it; an unknown session is a 404 naming it, a saved one from another tokenizer a 400."""
from __future__ import annotations

import openai
import pytest

from soma_runtime.engine.kv import BLOCK
from soma_runtime.errors import RequestError
from soma_runtime.server.sessions import Sessions
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model

SYSTEM = "You are a terse assistant."
FIRST = "Name a primary color."
SECOND = "Name another one."
ROUTES = ("show", "tokens", "blocks", "budget", "clear", "compress", "save")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, session: str, messages: list[dict], stream: bool = False) -> str:
    reply = client.chat.completions.create(model="default", messages=messages, max_tokens=16, temperature=0, stream=stream,
                                           extra_body={"session": session})
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    return reply.choices[0].message.content


def context_of(server, route: str, **body):
    status, payload = server.post(f"/v1/context/{route}", body)
    assert status == 200, payload
    return payload


def test_a_session_keeps_the_conversation_and_renders_each_prompt(client, server, smol):
    first = ask(client, "colors", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}])
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    assert first == smol.chat(conversation, stream=False, max_tokens=16, temperature=0)
    second = ask(client, "colors", [{"role": "user", "content": SECOND}], stream=True)
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": SECOND}]
    assert second == smol.chat(conversation, stream=False, max_tokens=16, temperature=0)
    mine = smol.context()
    mine.set_system(SYSTEM)
    for m in conversation[1:] + [{"role": "assistant", "content": second}]:
        mine.add_message(m["role"], m["content"])
    shown = context_of(server, "show", session="colors")
    assert shown["text"] == mine.show() and shown["tokens"] == mine.tokens()
    blocks = context_of(server, "blocks", session="colors")
    assert sum(b["tokens"] for b in blocks["blocks"]) == blocks["tokens"] == mine.tokens()
    assert context_of(server, "tokens", session="colors")["tokens"] == mine.tokens()


def test_budget_clear_save_and_load_on_a_session(client, server):
    for i in range(4):
        ask(client, "budgeted", [{"role": "user", "content": f"Say the number {i}."}])
    blocks = context_of(server, "budget", session="budgeted", block="history", tokens=30)
    history = next(b for b in blocks["blocks"] if b["block"] == "history")
    assert history["tokens"] <= 30 and history["cut"]["entries"] > 0 and blocks["cuts"][-1]["reason"] == "budget"
    assert "were cut from the history" in context_of(server, "show", session="budgeted")["text"]
    saved = context_of(server, "save", session="budgeted")
    restored = context_of(server, "load", session="restored", model="default", state=saved)
    assert restored["blocks"] == blocks["blocks"]
    assert context_of(server, "show", session="restored")["text"] == context_of(server, "show", session="budgeted")["text"]
    cleared = context_of(server, "clear", session="restored", what="history")
    assert all(b["entries"] == 0 for b in cleared["blocks"] if b["block"] in ("history", "input"))
    assert context_of(server, "clear", session="restored", what="session") == {"session": "restored", "deleted": True}
    assert server.post("/v1/context/show", {"session": "restored"})[0] == 404


@pytest.mark.parametrize("route", ROUTES)
def test_an_unknown_session_is_a_404_naming_it(server, route):
    body = {"session": "no-such-session", **({"block": "history", "tokens": 5} if route == "budget" else {})}
    status, error = server.post(f"/v1/context/{route}", body)
    assert status == 404 and "session 'no-such-session' does not exist" in error["error"]["message"], error
    assert error["error"]["code"] == "session_not_found"


def test_bad_sessions_are_400s(client, server):
    ask(client, "other", [{"role": "user", "content": "Hi."}])
    saved = context_of(server, "save", session="other")
    foreign = {**saved, "tokenizer": "0" * 64}
    status, error = server.post("/v1/context/load", {"session": "x", "model": "default", "state": foreign})
    assert status == 400 and "whose tokenizer differs" in error["error"]["message"]
    status, error = server.post("/v1/context/load", {"session": "x", "model": "default", "state": {"format": 99}})
    assert status == 400 and "not a saved session" in error["error"]["message"]
    assert server.post("/v1/context/show", {"session": "x"})[0] == 404             # a failed load starts nothing
    with pytest.raises(openai.BadRequestError, match="session id"):
        ask(client, "bad id!", [{"role": "user", "content": "Hi."}])
    with pytest.raises(openai.BadRequestError, match="no tools"):
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi."}], max_tokens=4,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                       extra_body={"session": "other"})
    status, error = server.post("/v1/context/budget", {"session": "other", "block": "input", "tokens": 1})
    assert status == 400 and "never cut" in error["error"]["message"]
    assert all(b["budget"] is None for b in context_of(server, "blocks", session="other")["blocks"])


def test_sessions_with_one_system_prompt_share_its_cached_pages(client, server):
    """The system block leads every session's prompt, so the prefix cache gives a second session its KV
    pages (the cache works in whole pages: at least the system block less one page is reused)."""
    system = "You answer questions about lighthouses, harbours and ships, in two sentences at most. " * 8
    usages = []
    for session in ("harbour-1", "harbour-2"):
        reply = client.chat.completions.create(model="default", max_tokens=4, temperature=0, extra_body={"session": session},
                                               messages=[{"role": "system", "content": system},
                                                         {"role": "user", "content": f"Question {session}?"}])
        usages.append(reply.usage)
    system_tokens = next(b["tokens"] for b in context_of(server, "blocks", session="harbour-2")["blocks"]
                         if b["block"] == "system")
    assert system_tokens > 120
    assert usages[1].prompt_tokens_details.cached_tokens >= system_tokens - BLOCK


def test_a_session_follows_a_hot_swap_only_to_a_model_that_renders_it_the_same(smol, tmp_path):
    sessions = Sessions()
    session = sessions.open("swap", "default", smol)
    session.context.add_message("user", "Hi.")
    twin = Runtime().load("default", progress=False)                 # the same file loaded again: a swap in place
    assert sessions.open("swap", "default", twin).model is twin and session.context.summarize == twin.summarize
    build_model("llama", str(tmp_path / "tiny"))
    other = Runtime().load(str(tmp_path / "tiny"), progress=False)
    with pytest.raises(RequestError, match="replaced by one with another tokenizer"):
        sessions.open("swap", "default", other)
    with pytest.raises(RequestError, match="not 'other'"):
        sessions.open("swap", "other", other)

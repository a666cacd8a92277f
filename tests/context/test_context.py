"""A conversation's Context on the bundled SmolLM2: show() is the prompt the model receives, blocks sum to
its tokens, budgets hold over 10,000 turns with every message either kept or recorded as cut (and the
prompt saying so), trim cuts the lowest priority first and keeps the newest, the system prompt and
input are never cut, and a saved session restores exactly, into this model's tokenizer only."""
from __future__ import annotations

import json

import pytest

from soma_runtime.context import BUDGETED
from soma_runtime.errors import ContextError
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model

SYSTEM = "You are a terse assistant. Answer in one sentence."
PAGES = ["# Paris\nParis is the capital of France.", "# Lyon\nLyon is on the Rhone.", "# Nice\nNice is on the coast."]


def conversation(smol, turns: int = 3):
    context = smol.context()
    context.set_system(SYSTEM)
    context.set_graph(PAGES)
    for i in range(turns):
        context.add_message("user", f"What is {i} plus {i}?")
        context.add_message("assistant", f"{i} plus {i} is {2 * i}.")
    context.inject_tool_result("calculator", {"result": 42})
    context.add_message("user", "And what is 21 plus 21?")
    return context


def kept(context) -> dict:
    return {b["block"]: b["entries"] for b in context.blocks()}


def test_show_is_the_prompt_the_model_receives(smol, monkeypatch):
    context = conversation(smol)
    shown, ids, messages = context.show(), context.ids(), context.messages()
    received = []
    run = smol.scheduler.run
    monkeypatch.setattr(smol.scheduler, "run", lambda req: received.append(req.prompt_ids) or run(req))
    reply = smol.chat(context, stream=False, max_tokens=12, temperature=0)
    assert received == [ids]
    assert smol.tokenizer.decode(received[0], skip_special=False) == shown
    assert shown == smol.template().render(messages)
    monkeypatch.undo()
    assert ids == smol.chat_ids(messages)                 # the plain chat path renders the same messages the same
    assert reply == smol.chat(messages, stream=False, max_tokens=12, temperature=0)
    assert context.messages()[-1] == {"role": "assistant", "content": reply} and kept(context)["input"] == 0


def test_a_streamed_reply_joins_the_context_once_it_ends(smol):
    context = conversation(smol)
    tokens = list(smol.chat(context, max_tokens=8, temperature=0))
    assert context.messages()[-1]["content"] == "".join(t.text for t in tokens)


def test_blocks_sum_to_the_prompts_tokens(smol):
    context = conversation(smol)
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"a": 21, "b": 21}'}}
    context.add_message("assistant", "Let me compute that.", tool_calls=[call])
    context.inject_tool_result("calculator", {"result": 42})
    blocks = {b["block"]: b["tokens"] for b in context.blocks()}
    assert sum(blocks.values()) == context.tokens() == len(smol.tokenizer.encode(context.show(), add_special=False))
    assert blocks["system"] == len(smol.tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", add_special=False))
    assert blocks["graph"] > 0 and blocks["history"] > 0 and blocks["tool_results"] > 0
    assert blocks["input"] == len(smol.tokenizer.encode("<|im_start|>assistant\n", add_special=False))   # its prompt
    assert blocks["notes"] == 0 and "context note" not in context.show()


def test_budgets_hold_over_10000_turns_and_nothing_is_dropped_silently(smol):
    context = smol.context()
    context.set_system(SYSTEM)
    context.set_graph(PAGES)
    budgets = {"graph": 30, "history": 400, "tool_results": 60}
    for block, tokens in budgets.items():
        context.set_budget(block, tokens)
    added = {"history": 0, "tool_results": 0}
    for turn in range(10_000):
        context.add_message("user", f"Turn {turn}: what is {turn} times 3?")
        if turn % 7 == 0:
            context.inject_tool_result("calculator", {"product": turn * 3})
            added["tool_results"] += 1
        context.add_message("assistant", f"{turn} times 3 is {turn * 3}." + " Indeed." * (turn % 5))
        added["history"] += 1
        blocks = {b["block"]: b for b in context.blocks()}
        assert all(blocks[b]["tokens"] <= budgets[b] for b in budgets), (turn, blocks)
        assert context.tokens() <= context.limit
    blocks = {b["block"]: b for b in context.blocks()}
    # each user message, assistant reply and tool result is in the context or counted as cut
    messages = 2 * added["history"] + added["tool_results"]
    in_context = blocks["history"]["entries"] + blocks["tool_results"]["entries"] + blocks["input"]["entries"]
    assert in_context + blocks["history"]["cut"]["entries"] + blocks["tool_results"]["cut"]["entries"] == messages
    assert sum(c.entries for c in context.cuts if c.block == "history") == blocks["history"]["cut"]["entries"]
    assert blocks["graph"]["cut"]["entries"] == 1 and blocks["graph"]["entries"] == 2     # the least relevant page
    shown = context.show()
    assert f"{blocks['history']['cut']['entries']} earlier messages" in shown and "1 pages" in shown
    assert "Turn 9999" in shown and PAGES[0] in shown and PAGES[2] not in shown


def test_trim_cuts_graph_then_the_oldest_history_and_keeps_the_newest(smol):
    context = conversation(smol, turns=6)
    before, history = context.show(), kept(context)["history"]
    context.trim(context.tokens() - 1)                     # the note on the cut costs tokens too: pages go until it fits
    assert 0 < kept(context)["graph"] < 3 and PAGES[0] in context.show() and PAGES[2] not in context.show()
    assert kept(context)["history"] == history and context.tokens() < len(smol.tokenizer.encode(before, add_special=False))
    blocks = {b["block"]: b["tokens"] for b in context.blocks()}
    context.trim(context.tokens() - blocks["history"] // 2)
    shown = context.show()
    assert kept(context)["graph"] == 0 and "What is 0 plus 0?" not in shown and "5 plus 5 is 10" in shown
    assert 0 < kept(context)["history"] < history
    assert shown.endswith("And what is 21 plus 21?<|im_end|>\n<|im_start|>assistant\n")
    assert {c.reason for c in context.cuts} == {"trim"} and context.cuts[0].block == "graph"
    with pytest.raises(ContextError, match="nothing left to cut"):
        context.trim(5)
    assert context.show() == shown                         # a refused change leaves the context as it was
    assert before != shown


def test_the_system_prompt_and_input_are_never_cut(smol):
    context = conversation(smol)
    shown = context.show()
    with pytest.raises(ContextError, match="system .* over its budget of 5; it is never cut"):
        context.set_budget("system", 5)
    with pytest.raises(ContextError, match="input"):
        context.set_budget("input", 3)
    assert context.show() == shown and all(b["budget"] is None for b in context.blocks())
    with pytest.raises(ContextError, match="more than"):
        context.add_message("user", "word " * (smol.context_length * 2))
    assert context.show() == shown


def test_clear_history_keeps_the_system_and_graph_and_reset_clears_all(smol):
    context = conversation(smol)
    context.set_budget("history", 20)
    context.clear_history()
    assert kept(context) == {"system": 0, "graph": 3, "notes": 0, "history": 0, "tool_results": 0, "input": 0}
    assert SYSTEM in context.show() and "context note" not in context.show()
    context.reset()
    assert context.tokens() == 0 and context.show() == "" and context.cuts == []
    assert all(b["budget"] is None for b in context.blocks())


def test_a_saved_session_restores_exactly(smol, tmp_path):
    context = conversation(smol, turns=8)
    context.set_budget("history", 120)
    context.save(tmp_path / "session.json")
    restored = smol.context()
    restored.load(tmp_path / "session.json")
    assert restored.show() == context.show() and restored.ids() == context.ids()
    assert restored.blocks() == context.blocks() and restored.cuts == context.cuts
    assert {b: restored.budgets[b] for b in BUDGETED} == context.budgets


def test_a_session_from_another_tokenizer_or_no_session_is_a_clear_error(smol, tmp_path):
    build_model("llama", str(tmp_path / "tiny"))
    tiny = Runtime().load(str(tmp_path / "tiny"), progress=False)
    other = tiny.context()
    other.add_message("user", "hello")
    other.save(tmp_path / "tiny.json")
    mine = conversation(smol)
    shown = mine.show()
    with pytest.raises(ContextError, match=f"saved for model '{tiny.id}', whose tokenizer differs from {smol.id}'s"):
        mine.load(tmp_path / "tiny.json")
    assert mine.show() == shown
    (tmp_path / "not.json").write_text(json.dumps({"messages": []}))
    with pytest.raises(ContextError, match="not a saved session"):
        mine.load(tmp_path / "not.json")
    state = json.loads((tmp_path / "tiny.json").read_text())
    (tmp_path / "broken.json").write_text(json.dumps({**state, **mine.identity(), "history": "oops"}))
    with pytest.raises(ContextError):
        mine.load(tmp_path / "broken.json")
    with pytest.raises(ContextError, match="cannot read"):
        mine.load(tmp_path / "missing.json")
    assert mine.show() == shown

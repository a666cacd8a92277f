"""A conversation's Context on the bundled SmolLM2: show() is the prompt the model receives, blocks sum to
its tokens, budgets hold over 10,000 turns with every message either kept or recorded as cut (and the
prompt saying so), trim cuts the lowest priority first and keeps the newest, the system prompt and
input are never cut, and a saved session restores exactly, into this model's tokenizer only."""
from __future__ import annotations

import json

import pytest

from soma_runtime.context import BUDGETED, Context
from soma_runtime.errors import ContextError
from soma_runtime.tasks import Runtime
from soma_runtime.text.chat import ChatTemplate
from tests.fixtures.decoders import build_model

SYSTEM = "You are a terse assistant. Answer in one sentence."
PAGES = ["# Paris\nParis is the capital of France.", "# Lyon\nLyon is on the Rhone.", "# Nice\nNice is on the coast."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama with a tokenizer of its own and a 512-token context."""
    directory = str(tmp_path_factory.mktemp("tiny"))
    build_model("llama", directory, max_position_embeddings=512)
    return Runtime().load(directory, progress=False)


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


def test_a_session_from_another_tokenizer_or_no_session_is_a_clear_error(smol, tiny, tmp_path):
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


class Summaries:
    """A stand-in summarizer: numbered summaries, and the transcripts it was given."""

    def __init__(self):
        self.transcripts = []

    def __call__(self, transcript: str, max_tokens: int) -> str:
        self.transcripts.append(transcript)
        return f"SUMMARY {len(self.transcripts)}: the user asked for sums."


def test_compression_starts_once_history_passes_half_the_window_and_show_reports_it(smol):
    summaries = Summaries()
    ours = Context(smol.template(), smol.tokenizer, 1024, name=smol.id, summarize=summaries)
    plain = Context(smol.template(), smol.tokenizer, 1024, name=smol.id)      # the same turns, never compressed
    for context in (ours, plain):
        context.set_system(SYSTEM)
    turn = 0
    while not summaries.transcripts:
        for context in (ours, plain):
            context.add_message("user", f"What is {turn} plus {turn}?")
            context.add_message("assistant", f"{turn} plus {turn} is {2 * turn}.")
        history = {b["block"]: b["tokens"] for b in plain.blocks()}["history"]
        assert (history > 512) == bool(summaries.transcripts), (turn, history)
        if not summaries.transcripts:
            assert ours.show() == plain.show()
        turn += 1
    blocks = {b["block"]: b for b in ours.blocks()}
    covered = ours.cuts[-1].entries
    assert ours.cuts[-1].reason == "compress" and covered + blocks["history"]["entries"] == 2 * turn
    assert blocks["history"]["tokens"] <= 1024 // 4 and blocks["history"]["cut"]["entries"] == 0   # nothing was cut
    shown = ours.show()
    assert f"[context note: {covered} earlier messages ({ours.cuts[-1].tokens} tokens) were compressed into this " \
           f"summary]\nSUMMARY 1: the user asked for sums." in shown
    assert "What is 0 plus 0?" in summaries.transcripts[0] and "What is 0 plus 0?" not in shown
    ours.compress()                                           # by hand: all but the newest two messages
    assert summaries.transcripts[1].startswith("Summary so far: SUMMARY 1") and "SUMMARY 2" in ours.show()
    assert {b["block"]: b["entries"] for b in ours.blocks()}["history"] == 2 and ours.summarized[0] == 2 * turn - 2


def test_the_model_compresses_its_own_history_and_the_session_keeps_the_summary(smol, tmp_path):
    context = smol.context(summarizer=smol)
    context.set_system(SYSTEM)
    for name, city in (("Alice", "Paris"), ("Bob", "Lyon"), ("Carol", "Nice")):
        context.add_message("user", f"My friend {name} lives in {city}.")
        context.add_message("assistant", f"Noted: {name} lives in {city}.")
    context.add_message("user", "Where does Alice live?")
    context.compress()
    assert context.summary and context.summary in context.show() and "compressed into this summary" in context.show()
    assert context.summarized[0] == 4 and "My friend Alice" not in context.show().split(context.summary)[1]
    context.save(tmp_path / "session.json")
    restored = smol.context()
    restored.load(tmp_path / "session.json")
    assert restored.show() == context.show() and restored.summarized == context.summarized
    assert smol.chat(restored, stream=False, max_tokens=8, temperature=0)
    with pytest.raises(ContextError, match="no summarizer"):
        restored.compress()


def test_escalation_fits_the_target_model_and_records_its_cuts(smol, tiny):
    context = conversation(smol, turns=20)
    small = context.escalate(tiny)
    assert small.window == 512 and small.tokens() <= small.limit
    assert small.ids() == tiny.tokenizer.encode(small.show(), add_special=False)      # in the target's own tokens
    assert small.show().endswith("And what is 21 plus 21?<|im_end|>\n<|im_start|>assistant\n")
    assert "19 plus 19 is 38" in small.show() and "0 plus 0 is 0" not in small.show() and SYSTEM in small.show()
    cut = {b["block"]: b["cut"]["entries"] for b in small.blocks()}
    assert cut["graph"] == 3 and cut["history"] > 0 and {c.reason for c in small.cuts} == {"window"}
    assert context.cuts == [] and context.show() == conversation(smol, turns=20).show()      # the source is unchanged
    back = small.escalate(smol)                       # back into a larger window: nothing more to cut
    assert back.cuts == [] and back.messages() == small.messages()


STRICT = ("{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>\n{% else %}"
          "{% if (m['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0)) %}"
          "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n"
          "{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def test_cuts_keep_whole_exchanges_for_a_template_that_needs_alternating_roles(smol):
    """Mistral's and Llama 2's templates refuse a conversation whose roles do not alternate from a user
    message: a cut history starts at a user message, and a message alone is estimated from its text."""
    context = Context(ChatTemplate(STRICT), smol.tokenizer, 512, name="strict")
    context.set_system(SYSTEM)
    context.set_budget("history", 120)
    for turn in range(60):
        context.add_message("user", f"Turn {turn}: what is {turn} times 3?")
        context.add_message("assistant", f"{turn} times 3 is {turn * 3}." + " Indeed." * (turn % 3))
        assert context.messages()[1]["role"] == "user"
        assert {b["block"]: b["tokens"] for b in context.blocks()}["history"] <= 120
    assert context.show().endswith("[assistant] 59 times 3 is 177. Indeed. Indeed.\n[assistant] ")
    assert sum(c.entries for c in context.cuts) % 2 == 0                   # exchanges, never half of one

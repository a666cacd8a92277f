"""A conversation's context (SPEC "context management"): what one model sees, in blocks (system, graph,
history, tool_results, input), each with a budget counted in the model's own tokens, rendered through the
model's chat template exactly as the model receives it.

Owns the blocks, their budgets, trimming, the record of what was cut, and sessions saved to a file.
Knows a tokenizer and a chat template, and a retrieval index only by its `retrieve` and `render`
(inject_graph); nothing of models, engines or servers (a TextModel makes one with `model.context()` and
generates from its `ids()`).

Rendering: one system message holds the system prompt, the graph pages, then the notes on what was cut
(so the model is told, and show() says so); then the history's messages, the tool results since the
last assistant message, and the input (the user message awaiting its reply), with the template's
generation prompt. A block's tokens are what it adds to the rendered prompt's tokens, so the blocks sum
to tokens() exactly (what a template adds on its own, such as a default system prompt, counts to the
block that brings it in). Templates must render a conversation's prefix as a prefix of its rendering (a
template that does not is still counted exactly, more slowly).

Nothing is cut silently: a block over its budget, or a context past its window (less the reply's room),
loses its lowest-priority entries first: graph pages from the lowest ranked, then history and tool
results from the oldest (a call's results go with it); every cut is recorded in `cuts` and the notes
in the prompt say what each block lost. The system prompt and the input are never cut: a change that
would need it is refused with a ContextError and leaves the context as it was.

Compression (given a summarizer: a function of a transcript and a token limit, such as a model's chat)
replaces the oldest history, with the summary before it, by one summary, shown in the notes with the
messages and tokens it covers; it runs on its own once the history passes half the window, before
anything would be cut.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import reprlib
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from soma_runtime.errors import ContextError, RequestError
from soma_runtime.text.chat import ChatTemplate, check_messages
from soma_runtime.text.tokenizer import Tokenizer, check_text

BLOCKS = ("system", "graph", "notes", "history", "tool_results", "input")      # in the order rendered
BUDGETED = ("system", "graph", "history", "tool_results", "input")
CUTTABLE = ("graph", "history", "tool_results")           # lowest priority first
NOUNS = {"graph": "pages", "history": "earlier messages", "tool_results": "tool results"}
REPLY_SHARE = 4               # the room kept for the reply by default: a quarter of the window ...
REPLY_TOKENS = 512            # ... at most this many tokens
SUMMARY_SHARE = 8             # a summary takes at most an eighth of the window ...
SUMMARY_TOKENS = 512          # ... and at most this many tokens
KEPT_SHARE = 4                # compression on its own keeps the newest history within a quarter of the window ...
KEPT_MESSAGES = 2             # ... and any compression at least the newest two messages
SESSION_FORMAT = 1            # the saved file's version
MAX_SESSION_BYTES = 256 * 2**20


@dataclass
class Entry:
    """A graph page or a message, with the tokens it adds rendered alone after a system message (an
    estimate that picks how many entries to cut; the cut itself is measured)."""
    message: dict
    tokens: int


@dataclass
class Cut:
    block: str
    entries: int
    tokens: int               # the block's tokens before the cut less those after
    reason: str               # "budget" (the block's), "window" (the context's), "trim" (asked for) or "compress"


Summarizer = Callable[[str, int], str]      # (transcript, at most this many tokens) -> summary


class Context:
    """One conversation as one model sees it (the module's docstring says how)."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer, window: int, reply_tokens: int | None = None,
                 name: str = "the model", summarize: Summarizer | None = None):
        """`window`: the model's context in tokens; `reply_tokens`: the room kept for the reply (the prompt
        gets at most window - reply_tokens); `name`: the model's, for messages; `summarize`: what compresses
        the history (None: it is cut instead)."""
        if reply_tokens is None:
            reply_tokens = min(REPLY_TOKENS, window // REPLY_SHARE)
        if type(reply_tokens) is not int or not 0 <= reply_tokens < window:
            raise ContextError(f"reply_tokens must be an integer in [0, {window}), got {reprlib.repr(reply_tokens)}")
        self.template, self.tokenizer, self.window, self.reply_tokens, self.name = template, tokenizer, window, reply_tokens, name
        self.summarize = summarize
        self._probe = self._count([{"role": "system", "content": ""}], False)
        self.reset()

    # --- inspect -------------------------------------------------------------------------------

    def tokens(self) -> int:
        """The prompt's tokens: what the model is given."""
        return len(self._measure()[1])

    def ids(self) -> list[int]:
        """The prompt's token ids, as the model receives them."""
        return list(self._measure()[1])

    def show(self) -> str:
        """The prompt as the model sees it (its chat template's rendering), notes on what was cut included."""
        return self._measure()[2]

    def blocks(self) -> list[dict]:
        """Each block: its tokens, budget (None: only the window bounds it), entries, and what was cut from it."""
        counts = self._measure()[0]
        compressed = {"history": self.summarized}
        return [{"block": b, "tokens": counts[b], "budget": self.budgets.get(b), "entries": len(self._entries(b)),
                 "cut": dict(zip(("entries", "tokens"), self.dropped.get(b, (0, 0)))),
                 "compressed": dict(zip(("entries", "tokens"), compressed.get(b, (0, 0))))} for b in BLOCKS]

    def report(self) -> dict:
        """tokens(), the limit and window, blocks() and the cuts: what the context commands and routes answer."""
        return {"tokens": self.tokens(), "limit": self.limit, "window": self.window, "blocks": self.blocks(),
                "cuts": [asdict(c) for c in self.cuts]}

    def messages(self) -> list[dict]:
        """The messages the chat template renders (copies)."""
        return [dict(m) for m in self._stages()[-1][1]]

    @property
    def limit(self) -> int:
        """The most tokens the prompt may take: the window less the reply's room."""
        return self.window - self.reply_tokens

    # --- structure -----------------------------------------------------------------------------

    def set_system(self, text: str) -> None:
        self._fitting(text, "the system prompt")
        with self._change():
            self.system = text

    def set_graph(self, pages: list[str]) -> None:
        """The graph block's pages, most relevant first (the least relevant are cut first)."""
        if not isinstance(pages, list) or not all(isinstance(p, str) for p in pages):
            raise ContextError("pages must be a list of strings")
        with self._change():
            self.graph = [self._page(self._fitting(p, "a page")) for p in pages]

    def inject_graph(self, query: str, index, top: int = 5, weights=None) -> list:
        """The `top` pages `index` (a context.index.PageIndex) ranks for `query` into the graph block, most
        relevant first, each as structured content (frontmatter, body, links); the block's budget and the
        window cut the least relevant whole pages, recorded as any cut is. A page that could never fit the
        window is not added and is recorded as cut ("window", 0 tokens: it never entered the prompt).
        Returns the hits, each with `kept` saying whether its page is in the block."""
        rendered = [(hit, index.render(hit)) for hit in index.retrieve(query, top=top, weights=weights)]
        unfit = [text for _, text in rendered if len(text) > self.window * self.tokenizer.max_token_chars]
        with self._change():
            self.graph = [self._page(check_text(text, "a page")) for _, text in rendered if text not in unfit]
            if unfit:
                self.cuts.append(Cut("graph", len(unfit), 0, "window"))
                n, t = self.dropped.get("graph", (0, 0))
                self.dropped["graph"] = (n + len(unfit), t)
        kept = {e.message["content"] for e in self.graph}
        return [{**hit.to_json(), "kept": text in kept} for hit, text in rendered]

    def add_message(self, role: str, content: str, **extra) -> None:
        """Append a user or assistant message (extra fields, such as tool_calls, kept as given). A user
        message becomes the input; the input before it, and the tool results, move to the history."""
        if role == "system":
            raise ContextError("the system prompt is one block: use set_system")
        if role == "tool":
            self.inject_tool_result(extra.get("name", "tool"), content)
            return
        if role not in ("user", "assistant"):
            raise ContextError(f"role must be user, assistant or tool, got {reprlib.repr(role)}")
        message = {"role": role, "content": self._fitting(content, f"a {role} message"), **extra}
        check_messages([message])
        with self._change():
            self.history += self.input + self.tool_results
            self.input, self.tool_results = [], []
            (self.input if role == "user" else self.history).append(self._entry(message))

    def inject_tool_result(self, name: str, result) -> None:
        """A tool's output (text, or anything JSON can write) into the tool-results block."""
        if not isinstance(name, str) or not name:
            raise ContextError(f"a tool result needs the tool's name, got {reprlib.repr(name)}")
        try:
            text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ContextError(f"tool {name!r}: its result is neither text nor JSON ({e})") from None
        with self._change():
            self.tool_results.append(self._entry({"role": "tool", "name": name, "content": self._fitting(text, "a tool result")}))

    # --- manage --------------------------------------------------------------------------------

    def set_budget(self, block: str, tokens: int | None) -> None:
        """At most `tokens` for `block` (None: no budget of its own); a block over it is cut at once (the
        system prompt and the input never are: their budget is refused instead)."""
        if block not in BUDGETED:
            raise ContextError(f"block must be one of {', '.join(BUDGETED)}, got {reprlib.repr(block)}")
        check_budget(tokens)
        with self._change():
            self.budgets[block] = tokens

    def trim(self, max_tokens: int) -> None:
        """Cut the lowest-priority entries until the prompt takes at most `max_tokens` (graph pages, then
        history, then tool results; the oldest or least relevant first)."""
        if type(max_tokens) is not int or max_tokens < 0:
            raise ContextError(f"max_tokens must be an integer >= 0, got {reprlib.repr(max_tokens)}")
        with self._change():
            self._shrink(max_tokens, "trim")

    def compress(self) -> None:
        """Summarize the history (and the summary before it) into one summary, all but its newest two
        messages; recorded in `cuts` as "compress". (Past half the window it happens on its own, keeping
        the newest messages within a quarter of the window.)"""
        if self.summarize is None:
            raise ContextError(f"this context of {self.name} has no summarizer (model.context(summarizer=...))")
        with self._change():
            self._compress(0)

    def escalate(self, model) -> Context:
        """This conversation carried into another text model's context (`model.context()`: its tokenizer,
        template, window and summarizer): every block and the record of earlier cuts, then compressed or cut
        to fit there, lowest priority first, as any change is (those cuts are the new context's)."""
        target = model.context()
        with target._change():
            target.system, target.summary, target.summarized = self.system, self.summary, self.summarized
            target.dropped = dict(self.dropped)
            target.graph = [target._page(e.message["content"]) for e in self.graph]
            for block in ("history", "tool_results", "input"):
                setattr(target, block, [target._entry(e.message) for e in self._entries(block)])
        return target

    def clear_history(self) -> None:
        """Keep the system prompt and graph; the conversation (history, tool results, input) goes."""
        with self._change():
            self.history, self.tool_results, self.input = [], [], []
            self.summary, self.summarized = "", (0, 0)
            for block in ("history", "tool_results"):
                self.dropped.pop(block, None)

    def reset(self) -> None:
        """Everything goes: blocks, budgets and the record of cuts."""
        self.system, self.graph, self.history, self.tool_results, self.input = "", [], [], [], []
        self.budgets: dict[str, int | None] = dict.fromkeys(BUDGETED)
        self.dropped: dict[str, tuple[int, int]] = {}
        self.summary, self.summarized = "", (0, 0)          # the history's summary; (messages, tokens) it covers
        self.cuts: list[Cut] = []
        self._measured = None

    # --- persist -------------------------------------------------------------------------------

    def identity(self) -> dict:
        """What a saved session must match to be loaded here: the tokenizer and the chat template."""
        return identity(self.template, self.tokenizer)

    def state(self) -> dict:
        """The session as JSON-ready data: blocks, budgets, the record of cuts, the model it is for."""
        return {"format": SESSION_FORMAT, "model": self.name, **self.identity(), "window": self.window,
                "reply_tokens": self.reply_tokens, "system": self.system, "graph": [e.message["content"] for e in self.graph],
                **{b: [e.message for e in self._entries(b)] for b in ("history", "tool_results", "input")},
                "budgets": self.budgets, "dropped": self.dropped, "summary": self.summary, "summarized": self.summarized,
                "cuts": [asdict(c) for c in self.cuts]}

    def save(self, path: str) -> None:
        """state() as a JSON file, written whole or not at all."""
        directory = os.path.dirname(os.path.abspath(path))
        with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp", encoding="utf-8") as f:
            json.dump(self.state(), f, ensure_ascii=False)
        os.replace(f.name, path)

    def load(self, path: str) -> None:
        """Restore the session saved at `path` into this context (restore)."""
        self.restore(read_session(path), str(path))

    def restore(self, state: dict, source: str = "the session") -> None:
        """Restore a state() into this context; one saved for another tokenizer or chat template is a
        ContextError naming both models (`source`: where it came from, for messages). A window smaller than
        the saved one cuts (and records) as usual."""
        if not isinstance(state, dict) or state.get("format") != SESSION_FORMAT:
            raise ContextError(f"{source}: not a saved session of format {SESSION_FORMAT}")
        mine = self.identity()
        for key, what in (("tokenizer", "tokenizer"), ("template", "chat template")):
            if state.get(key) != mine[key]:
                raise ContextError(f"{source}: saved for model {state.get('model')!r}, whose {what} differs from "
                                   f"{self.name}'s; a session loads only into a model that tokenizes it the same")
        try:
            with self._change():
                self.reset()
                self.system = check_text(state["system"], "the system prompt")
                self.graph = [self._page(check_text(p, "a page")) for p in state["graph"]]
                for block in ("history", "tool_results", "input"):
                    if state[block]:
                        check_messages(state[block])
                    setattr(self, block, [self._entry(m) for m in state[block]])
                self.budgets.update({b: check_budget(state["budgets"][b]) for b in BUDGETED})
                self.dropped = {b: (int(n), int(t)) for b, (n, t) in state["dropped"].items() if b in CUTTABLE}
                self.summary = check_text(state["summary"], "the summary")
                self.summarized = tuple(int(v) for v in state["summarized"])
                self.cuts = [Cut(**c) for c in state["cuts"]]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ContextError(f"{source}: not a saved session of this format ({type(e).__name__}: {e})") from None
        except RequestError as e:           # messages a template refuses, or blocks this window cannot hold
            raise ContextError(f"{source}: cannot restore the saved session: {e}") from None

    # --- internals -----------------------------------------------------------------------------

    def _entries(self, block: str) -> list[Entry]:
        """A block's entries (the system prompt and the notes have none)."""
        return getattr(self, block) if block in CUTTABLE or block == "input" else []

    def _entry(self, message: dict) -> Entry:
        try:
            return Entry(message, self._count([{"role": "system", "content": ""}, message], False) - self._probe)
        except RequestError:         # a template that takes no message alone after a system one: its text's tokens
            return Entry(message, len(self.tokenizer.encode(message["content"], add_special=False)))

    def _fitting(self, text: str, what: str) -> str:
        """`text`, if it is text that could fit the window: more characters than the window's tokens could
        ever cover are refused before anything tokenizes them."""
        check_text(text, what)
        if len(text) > self.window * self.tokenizer.max_token_chars:
            raise ContextError(f"{what} of {len(text)} characters cannot fit the {self.window} tokens of {self.name}")
        return text

    def _page(self, text: str) -> Entry:
        return Entry({"role": "system", "content": text}, len(self.tokenizer.encode("\n\n" + text, add_special=False)))

    def _notes(self) -> str:
        notes = [f"[context note: {n} {NOUNS[b]} ({t} tokens) were cut from the {b.replace('_', ' ')} to fit the context]"
                 for b, (n, t) in self.dropped.items() if n]
        if self.summary:
            n, t = self.summarized
            notes.append(f"[context note: {n} earlier messages ({t} tokens) were compressed into this summary]\n{self.summary}")
        return "\n".join(notes)

    def _stages(self) -> list[tuple[str, list[dict], bool]]:
        """(block, the messages rendered once it is in, whether with the generation prompt), in BLOCKS order."""
        def head(*parts):
            text = "\n\n".join(p for p in parts if p)
            return [{"role": "system", "content": text}] if text else []
        pages = "\n\n".join(e.message["content"] for e in self.graph)
        conversation = head(self.system, pages, self._notes())
        stages = [("system", head(self.system), False), ("graph", head(self.system, pages), False),
                  ("notes", conversation, False)]
        for block in ("history", "tool_results", "input"):
            conversation = conversation + [e.message for e in self._entries(block)]
            stages.append((block, conversation, block == "input"))
        return stages

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.template.render(messages, generation_prompt) if messages else ""

    def _count(self, messages: list[dict], generation_prompt: bool) -> int:
        return len(self.tokenizer.encode(self._render(messages, generation_prompt), add_special=False))

    def _measure(self) -> tuple[dict[str, int], list[int], str]:
        """(tokens per block, the prompt's ids, its text), computed once per change: the whole prompt is
        tokenized once and each stage's rendering, a prefix of it, is counted by where its tokens start."""
        if self._measured is None:
            stages = self._stages()
            text = self._render(stages[-1][1], True)
            ids, starts = self.tokenizer.token_starts(text) if text else ([], [])
            counts, before, previous = {}, 0, []
            for block, messages, last in stages:
                if last:
                    upto = len(ids)
                elif messages == previous:          # an empty block adds nothing: no rendering needed
                    upto = before
                else:
                    prefix = self._render(messages, False)
                    upto = bisect.bisect_left(starts, len(prefix)) if text.startswith(prefix) else self._count(messages, False)
                counts[block], before, previous = upto - before, upto, messages
            self._measured = (counts, ids, text)
        return self._measured

    @contextmanager
    def _change(self) -> Iterator[None]:
        """A change, then the budgets and the window kept (cutting what must go); on any error the context
        is as it was before the change."""
        saved = (self.system, list(self.graph), list(self.history), list(self.tool_results), list(self.input),
                 dict(self.budgets), dict(self.dropped), self.summary, self.summarized, list(self.cuts))
        try:
            self._measured = None
            yield
            self._fit()
        except BaseException:
            (self.system, self.graph, self.history, self.tool_results, self.input, self.budgets, self.dropped,
             self.summary, self.summarized, self.cuts) = saved
            self._measured = None
            raise

    def _fit(self) -> None:
        """The history compressed once past half the window (with a summarizer), each block within its budget,
        then the whole within the limit; the system prompt or input over its budget is a ContextError."""
        if self.summarize is not None and self._measure()[0]["history"] > self.window // 2:
            self._compress(self.window // KEPT_SHARE)
        while True:
            counts = self._measure()[0]
            over = [b for b in BUDGETED if self.budgets[b] is not None and counts[b] > self.budgets[b]]
            cuttable = [b for b in over if b in CUTTABLE and self._entries(b)]
            if cuttable:
                self._cut(cuttable[0], counts[cuttable[0]] - self.budgets[cuttable[0]], "budget")
                continue
            if over:
                b = over[0]
                raise ContextError(f"the {b.replace('_', ' ')} takes {counts[b]} tokens of {self.name}, over its budget "
                                   f"of {self.budgets[b]}" + ("" if b in CUTTABLE else "; it is never cut"))
            break
        self._shrink(self.limit, "window")

    def _shrink(self, max_tokens: int, reason: str) -> None:
        while (total := self.tokens()) > max_tokens:
            block = next((b for b in CUTTABLE if self._entries(b)), None)
            if block is None:
                counts = self._measure()[0]
                raise ContextError(f"the context needs {total} tokens of {self.name}, more than {max_tokens} "
                                   f"({reason}), with nothing left to cut: system {counts['system']}, "
                                   f"input {counts['input']} tokens")
            self._cut(block, total - max_tokens, reason)

    def _compress(self, kept_tokens: int) -> None:
        """Summarize all history but its newest messages within `kept_tokens` (at least KEPT_MESSAGES)."""
        counts = self._measure()[0]
        keep, kept = len(self.history), 0
        while keep > 0 and (len(self.history) - keep < KEPT_MESSAGES or kept + self.history[keep - 1].tokens <= kept_tokens):
            keep -= 1
            kept += self.history[keep].tokens
        while 0 < keep < len(self.history) and self.history[keep].message["role"] != "user":     # whole exchanges
            keep += 1
        old = self.history[:keep]
        if not old:
            return
        earlier = [f"Summary so far: {self.summary}"] if self.summary else []
        transcript = "\n".join(earlier + [f"{e.message['role']}: {e.message['content']}" for e in old])
        limit = min(SUMMARY_TOKENS, self.window // SUMMARY_SHARE)
        summary = self.summarize(transcript, limit)
        if not isinstance(summary, str) or not summary.strip():
            raise ContextError(f"the summarizer gave no summary of {len(old)} messages")
        self.history = self.history[keep:]
        self.summary = summary.strip()
        self._measured = None
        tokens = counts["history"] - self._measure()[0]["history"]
        n, t = self.summarized
        self.summarized = (n + len(old), t + tokens)
        self.cuts.append(Cut("history", len(old), tokens, "compress"))
        self._measured = None

    def _cut(self, block: str, excess: int, reason: str) -> None:
        """Drop `block`'s lowest-priority entries, at least one, until their estimated tokens reach `excess`;
        record the cut as measured."""
        before = self._measure()[0][block]
        entries, dropped, freed = self._entries(block), 0, 0
        while entries and (freed < excess or dropped == 0):
            freed += entries.pop(-1 if block == "graph" else 0).tokens
            dropped += 1
            while block == "history" and entries and entries[0].message["role"] != "user":   # whole exchanges go
                freed += entries.pop(0).tokens
                dropped += 1
        self._measured = None
        tokens = before - self._measure()[0][block]
        self.cuts.append(Cut(block, dropped, tokens, reason))
        n, t = self.dropped.get(block, (0, 0))
        self.dropped[block] = (n + dropped, t + tokens)
        self._measured = None


def read_session(path: str) -> dict:
    """A saved session's JSON object (ContextError for a file that cannot be read or is not one)."""
    try:
        if os.path.getsize(path) > MAX_SESSION_BYTES:
            raise ContextError(f"{path}: larger than {MAX_SESSION_BYTES} bytes; not a saved session")
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise ContextError(f"{path}: cannot read a saved session ({type(e).__name__}: {e})") from None
    return state


def identity(template: ChatTemplate, tokenizer: Tokenizer) -> dict:
    """A tokenizer's and a chat template's digests: two models that share them render a context the same."""
    return {"tokenizer": tokenizer.fingerprint, "template": hashlib.sha256(template.source.encode()).hexdigest()}


def check_budget(tokens):
    """`tokens` itself, if it is a budget: an integer >= 0, or None for none."""
    if tokens is not None and (type(tokens) is not int or tokens < 0):
        raise ContextError(f"a budget must be an integer >= 0 or None, got {reprlib.repr(tokens)}")
    return tokens

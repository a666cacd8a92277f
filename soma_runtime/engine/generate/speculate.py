"""Speculative decoding's drafts: a stream's likely next tokens, found cheaply, so that one target step
checks several. A drafter proposes tokens (each a single token, never a distribution: the target's
verification in `Stream.verify` then keeps its distribution exactly); `DraftLength` adapts how many to a
stream's running acceptance. Drafters: prompt lookup (the text so far continues an earlier n-gram), a
draft model with the same vocabulary, and the target's own first layers (`Engine.first_layers`).
Owns the drafts; knows a stream's history and an Engine's forward, nothing of scheduling.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from soma_runtime.engine.kv import BASE, Sequence, Variant
from soma_runtime.errors import RequestError

LONGEST_DRAFT = 8          # draft tokens a step at most
LOOKUP_NGRAM = (3, 2)      # prompt lookup matches the last 3, then 2 tokens (one alone proves too little)
POOR_RATE = 0.25           # a stream whose drafts are accepted less often than this ...
REST_STEPS = 16            # ... stops drafting for this many steps, then tries a single token; each poor
LONGEST_REST = 256         # spell in a row doubles the rest, up to this
IDLE_STEPS = 4             # a stream the drafter had nothing for this many steps in a row rests too; after a
                           # rest, one more empty step rests it again, each idle rest twice the last


@dataclass
class DraftLength:
    """How many tokens to draft for one stream: one more after a step that kept them all, one fewer after
    a rejection; a stream whose running acceptance falls below POOR_RATE rests (plain steps) a while,
    longer each time until a draft is accepted again, and so does one the drafter keeps finding nothing for
    (a resting stream's steps may run ahead on a GPU; a step that looks for drafts may not, so free writing
    that never matches must look ever more rarely to stay as fast as plain decoding)."""
    tokens: int = 4
    rate: float = 1.0             # running share of draft tokens accepted
    resting: int = 0
    rest: int = REST_STEPS        # the next rest's length
    empty: int = 0                # steps in a row the drafter proposed nothing

    def next(self) -> int:
        if self.resting:
            self.resting -= 1
            return 0
        return self.tokens

    def update(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.empty = 0
        self.rate = 0.8 * self.rate + 0.2 * accepted / drafted
        self.tokens = min(LONGEST_DRAFT, self.tokens + 1) if accepted == drafted else max(1, self.tokens - 1)
        if accepted:
            self.rest = REST_STEPS
        if self.rate < POOR_RATE:
            self.resting, self.tokens, self.rate = self.rest, 1, POOR_RATE
            self.rest = min(LONGEST_REST, 2 * self.rest)

    def nothing_found(self) -> None:
        self.empty += 1
        if self.empty >= IDLE_STEPS:
            self.resting, self.empty = self.rest, IDLE_STEPS - 1
            self.rest = min(LONGEST_REST, 2 * self.rest)


class Drafter:
    """Proposes each stream's next tokens. `propose` gets the streams' histories (every token so far, the
    last one not yet run by the target), how many tokens each may take and what each runs under (its
    adapter: kv.Variant); `release` forgets a stream."""

    def propose(self, histories: list[list[int]], counts: list[int], keys: list[int],
                variants: list[Variant]) -> list[list[int]]:
        raise NotImplementedError

    def release(self, key: int) -> None:
        pass


class PromptLookup(Drafter):
    """Model-free drafts: where the history's last n tokens (n = 3, then 2) occurred before, the tokens that
    followed them there (their latest occurrence). Shines on input-grounded text (summaries, edits, code)."""

    def __init__(self, ngrams: tuple[int, ...] = LOOKUP_NGRAM):
        self.ngrams = ngrams

    def propose(self, histories, counts, keys, variants):
        return [lookup(np.asarray(h, np.int64), k, self.ngrams) if k else [] for h, k in zip(histories, counts)]


def lookup(history: np.ndarray, count: int, ngrams: tuple[int, ...]) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the history's last n-gram, the
    longest of `ngrams` that occurred."""
    for n in ngrams:
        if n >= len(history):
            continue
        windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)
        hits = np.flatnonzero((windows == history[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return history[start: start + count].tolist()
    return []


class DraftModel(Drafter):
    """Drafts by a smaller model of the same vocabulary, run greedily on an Engine of its own (each stream a
    sequence in its KV pool, caught up with the history, rolled back past tokens the target rejected). With
    `adapters`, the engine shares the target's LoRA slots (its own first layers): a stream drafts under its
    adapter; else under none."""

    def __init__(self, engine, adapters: bool = False):
        self.engine, self.adapters = engine, adapters
        self.fed: dict[int, tuple[Sequence, list[int]]] = {}      # stream -> its sequence, the tokens it ran

    def propose(self, histories, counts, keys, variants):
        live = [i for i, k in enumerate(counts) if k]
        drafts: list[list[int]] = [[] for _ in counts]
        feeds = {}
        for i in live:
            variant = variants[i] if self.adapters and self.engine.lora is not None else BASE
            seq, fed = self.fed.setdefault(keys[i], (Sequence(variant=variant), []))
            kept = min(common_prefix(fed, histories[i]), len(histories[i]) - 1)
            seq.length, fed[kept:] = kept, []
            feeds[i] = histories[i][kept:]
        try:
            while live:
                rows = self.engine.forward([(self.fed[keys[i]][0], feeds[i], 1) for i in live])
                for i, row in zip(live, rows):
                    self.fed[keys[i]][1].extend(feeds[i])
                    drafts[i].append(int(np.argmax(row[-1])))
                    feeds[i] = drafts[i][-1:]
                live = [i for i in live if len(drafts[i]) < counts[i]]
        except RequestError:             # the draft's KV pool is full: these streams step plainly, starting afresh
            for i in live:
                self.release(keys[i])
                drafts[i] = []
        return drafts

    def release(self, key):
        if key in self.fed:
            self.engine.pool.release(self.fed.pop(key)[0])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n

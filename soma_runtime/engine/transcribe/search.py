"""Token search for one window, as CTranslate2's whisper `generate` runs it (faster-whisper's engine), as
steps that run in lockstep with other windows' searches: greedy, beam search (2 x beam candidates a step,
finished hypotheses replaced by the next live candidates, patience, length penalty) and temperature sampling
over `num_hypotheses` rows, each step's logits first through whisper's rules: suppressed tokens, a blank
start suppressed, and timestamps (paired, never decreasing, at most `max_initial_timestamp_index` at the
start, forced when their summed probability beats every text token). Scores are float32 log-probabilities,
finalized as score / length^penalty.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from soma_runtime.engine.kv import Sequence
from soma_runtime.engine.transcribe.lockstep import Forward, Steps, lockstep
from soma_runtime.engine.transcribe.runner import Hypothesis, WhisperRunner, Window
from soma_runtime.engine.transcribe.tokens import WhisperTokens
from soma_runtime.errors import RequestError

LOWEST = np.finfo(np.float32).min          # what a disabled token's logit becomes (CTranslate2's value)


@dataclass
class SearchOptions:
    beam_size: int = 5
    patience: float = 1.0
    length_penalty: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    temperature: float = 0.0
    num_hypotheses: int = 1
    max_length: int = 448
    suppress_tokens: tuple[int, ...] = ()
    suppress_blank: tuple[int, ...] = ()      # suppressed at the first step only (a blank, end of text)
    max_initial_timestamp_index: int = 50

    def check(self) -> None:
        if type(self.beam_size) is not int or not 1 <= self.beam_size <= 32:
            raise RequestError(f"beam_size must be an integer in [1, 32], got {self.beam_size!r}")
        if not 0 < self.patience <= 8:
            raise RequestError(f"patience must be in (0, 8], got {self.patience!r}")
        if not 0 <= self.temperature <= 2:
            raise RequestError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not self.repetition_penalty > 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")


@dataclass
class SearchResult:
    tokens: list[int]          # the generated tokens, end of text excluded
    score: float               # the finalized score: cumulative log-probability / length^length_penalty
    no_speech_prob: float


def log_softmax(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True, dtype=np.float32))


class LogitRules:
    """Every step's logit processing, in CTranslate2's order, on [rows, vocab] float32 logits in place."""

    def __init__(self, tok: WhisperTokens, opts: SearchOptions, timestamps: bool):
        self.tok, self.opts, self.timestamps = tok, opts, timestamps
        self.suppress = np.asarray(opts.suppress_tokens, np.int64)
        self.begin = np.asarray(opts.suppress_blank, np.int64)

    def apply(self, step: int, logits: np.ndarray, histories: list[list[int]]) -> None:
        o = self.opts
        if o.repetition_penalty != 1:
            for row, history in zip(logits, histories):
                seen = np.unique(np.asarray(history, np.int64))
                row[seen] = np.where(row[seen] < 0, row[seen] * o.repetition_penalty, row[seen] / o.repetition_penalty)
        if o.no_repeat_ngram_size > 0:
            n = o.no_repeat_ngram_size
            for row, history in zip(logits, histories):
                if len(history) >= n:
                    tail = tuple(history[len(history) - n + 1:])
                    banned = {history[i + n - 1] for i in range(len(history) - n + 1) if tuple(history[i:i + n - 1]) == tail}
                    row[list(banned)] = LOWEST
        logits[:, self.suppress] = LOWEST
        if step == 0:
            logits[:, self.begin] = LOWEST
        if self.timestamps:
            self.timestamp_rules(step, logits, histories)

    def timestamp_rules(self, step: int, logits: np.ndarray, histories: list[list[int]]) -> None:
        tok, begin = self.tok, self.tok.timestamp_begin
        check = []
        for i, (row, history) in enumerate(zip(logits, histories)):
            row[tok.no_timestamps] = LOWEST
            if step == 0:
                row[:begin] = LOWEST                                     # a window opens with a timestamp ...
                row[begin + self.opts.max_initial_timestamp_index + 1:] = LOWEST   # ... an early one
                continue
            last = history[-1]
            if last >= begin:
                penultimate = history[-2] if step > 1 else last
                if penultimate >= begin:                                # a pair is closed: text follows
                    row[begin:] = LOWEST
                else:                                                   # a pair is open: close it, or end
                    row[:tok.eot] = LOWEST
                    row[begin:last] = LOWEST
                    check.append(i)
            else:
                check.append(i)
                previous = next((t for t in reversed(history) if t >= begin), None)
                if previous is not None:                                # timestamps never go back
                    row[begin:previous + 1] = LOWEST
        for i in check:
            logp = log_softmax(logits[i])
            stamps = logp[begin:]
            top = stamps.max()
            if top + np.log(np.exp(stamps - top).sum(dtype=np.float32)) > logp[:begin].max():
                logits[i, :begin] = LOWEST


def split_prompt(prompt: list[int], tok: WhisperTokens) -> tuple[list[int], int, int]:
    """(tokens before the start token, the start token, the sot's index): the start is the last of
    sot and the task tokens after it, as CTranslate2 splits a prompt."""
    if tok.sot not in prompt:
        raise RequestError("a whisper prompt holds <|startoftranscript|>")
    sot = prompt.index(tok.sot)
    end = sot
    while end < len(prompt) and tok.sot <= prompt[end] <= tok.no_timestamps:
        end += 1
    if end != len(prompt):
        raise RequestError("a whisper prompt ends with its start sequence (text prefixes are not taken)")
    return prompt[:end - 1], prompt[end - 1], sot


class Search:
    """One window's decoding from `prompt`."""

    def __init__(self, runner: WhisperRunner, tok: WhisperTokens, opts: SearchOptions, rng: np.random.Generator | None = None):
        opts.check()
        self.runner, self.tok, self.opts = runner, tok, opts
        self.rng = rng if rng is not None else np.random.default_rng()

    def run(self, window: Window, prompt: list[int]) -> SearchResult:
        [(_, result)] = lockstep(self.runner, [self.decode(window, prompt)])
        return result

    def decode(self, window: Window, prompt: list[int]) -> Steps:
        """The decoding as steps (see lockstep): yields each decoder step it needs, returns its result."""
        before, start, sot = split_prompt(prompt, self.tok)
        rules = LogitRules(self.tok, self.opts, timestamps=start != self.tok.no_timestamps)
        max_length = min(self.opts.max_length // 2, self.opts.max_length - len(before))
        if max_length < 1:
            raise RequestError(f"a prompt of {len(prompt)} tokens leaves no room in whisper's {self.opts.max_length}")
        root = Hypothesis(Sequence(), window)
        feed = [*before, start]
        try:
            logits = yield Forward([(root, feed)], [sot, len(feed) - 1] if sot < len(before) else [len(feed) - 1])
        except BaseException:
            self.runner.release(root)
            raise
        no_speech = softmax_at(logits[0], self.tok.no_speech)       # at the sot, before any rule
        search = self.greedy if self.opts.beam_size == 1 else self.beam
        tokens, score = yield from search(root, logits[-1:], rules, max_length)     # the search owns root from here
        return SearchResult(tokens, score, no_speech)

    def greedy(self, root: Hypothesis, logits: np.ndarray, rules: LogitRules, max_length: int) -> Steps:
        """Greedy (temperature 0) or sampled rows; the best finalized row."""
        n = self.opts.num_hypotheses if self.opts.temperature > 0 else 1
        rows = [root] + [self.runner.fork(root) for _ in range(n - 1)]
        logits = np.repeat(logits, n, axis=0)
        histories, scores = [[] for _ in range(n)], np.zeros(n, np.float32)
        alive, done = list(range(n)), {}
        try:
            for step in range(max_length):
                rules.apply(step, logits, [histories[i] for i in alive])
                logp = log_softmax(logits)
                chosen = self.choose(logits, logp)
                feed = []
                for j, i in enumerate(alive):
                    token = int(chosen[j])
                    scores[i] += logp[j, token]
                    if token != self.tok.eot:
                        histories[i].append(token)
                    if token == self.tok.eot or step + 1 == max_length:
                        done[i] = finalize(scores[i], len(histories[i]), self.opts.length_penalty)
                    else:
                        feed.append((i, token))
                alive = [i for i, _ in feed]
                if not alive:
                    break
                logits = yield Forward([(rows[i], [token]) for i, token in feed])
        finally:
            for h in rows:
                self.runner.release(h)
        best = max(done, key=lambda i: (done[i], -i))
        return histories[best], done[best]

    def choose(self, logits: np.ndarray, logp: np.ndarray) -> np.ndarray:
        if self.opts.temperature == 0:
            return logp.argmax(axis=-1)
        scaled = logp.astype(np.float64) / self.opts.temperature
        cdf = np.cumsum(np.exp(scaled - scaled.max(axis=-1, keepdims=True)), axis=-1)
        draws = self.rng.random(len(cdf)) * cdf[:, -1]
        return np.asarray([np.searchsorted(row, u, side="right") for row, u in zip(cdf, draws)])

    def beam(self, root: Hypothesis, logits: np.ndarray, rules: LogitRules, max_length: int) -> Steps:
        o, eot = self.opts, self.tok.eot
        width, candidates = o.beam_size, 2 * o.beam_size
        max_candidates = round(width * o.patience)
        early_exit = o.length_penalty == 0
        beams, histories, scores = [root], [[]], None
        results: list[tuple[float, list[int]]] = []
        top_finished = False
        try:
            for step in range(max_length):
                rules.apply(step, logits, histories)
                logp = log_softmax(logits)
                if scores is not None:
                    logp += scores[:, None]
                flat = logp.reshape(-1)
                top = np.argpartition(-flat, candidates)[:candidates]
                top = top[np.lexsort((top, -flat[top]))]
                origin, token, score = top // logits.shape[1], top % logits.shape[1], flat[top]
                last = step + 1 == max_length
                secondary, active = width, []
                for k in range(width):
                    chosen = k
                    if token[k] == eot or last:
                        top_finished |= k == 0
                        results.append((score[k], histories[origin[k]] + ([] if token[k] == eot else [int(token[k])])))
                        for j in range(secondary, candidates):
                            if token[j] != eot:
                                chosen, secondary = j, j + 1
                                break
                    active.append(chosen)
                finished = last or (top_finished and len(results) >= o.num_hypotheses if early_exit
                                    else len(results) >= max_candidates)
                if finished:
                    break
                beams = self.regroup(beams, [int(origin[c]) for c in active])
                histories = [histories[origin[c]] + [int(token[c])] for c in active]
                scores = np.asarray([score[c] for c in active], np.float32)
                logits = yield Forward([(h, [t[-1]]) for h, t in zip(beams, histories)])
        finally:
            for h in beams:
                self.runner.release(h)
        ranked = sorted(((finalize(s, len(t), o.length_penalty), t) for s, t in results), key=lambda r: -r[0])
        return ranked[0][1], ranked[0][0]

    def regroup(self, beams: list[Hypothesis], parents: list[int]) -> list[Hypothesis]:
        """The next step's beams from their parents: a parent's last use takes its cache, earlier uses
        fork it; parents nobody continues are released."""
        uses = {p: parents.count(p) for p in set(parents)}
        out = []
        for p in parents:
            uses[p] -= 1
            out.append(beams[p] if uses[p] == 0 else self.runner.fork(beams[p]))
        for i, h in enumerate(beams):
            if i not in uses:
                self.runner.release(h)
        return out


def finalize(score, length: int, penalty: float) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float32(score) / np.float32(length) ** np.float32(penalty))


def softmax_at(row: np.ndarray, index: int) -> float:
    e = np.exp(row - row.max())
    return float(e[index] / e.sum(dtype=np.float32))

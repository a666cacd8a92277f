"""The sampling pipeline, in SPEC order: repetition penalty (and OpenAI's presence/frequency
penalties over the generated tokens) -> temperature -> top-k -> top-p -> min-p -> draw.
Temperature 0 is greedy. Each stage is a small function over a logits vector.

After the penalties, a choice is `choose(logits, row)` with row = (temperature, top_k, top_p, min_p,
u), u the step's uniform: the decoder graph's `sample` op takes the same rows, so a stream without
penalties or logprobs is sampled where the model runs, and only its token comes back."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from soma_runtime.errors import RequestError

MAX_TOP_K = 2**31            # top_k and repeat_last_n: at most a vocabulary's (or a context's) size
SEED_LIMIT = 2**64           # what numpy's generators take
LAST_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    @property
    def penalized(self) -> bool:
        """Whether the history changes the logits (the choice then needs them on the host)."""
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def fits(self, width: int) -> bool:
        """Whether the choice needs only the `width` most likely tokens (what the `sample` op sees)."""
        return not self.penalized and (self.temperature == 0 or 1 <= self.top_k <= width)

    def validate(self) -> SamplingParams:
        """Raise RequestError naming the first field of the wrong type or out of its range. A seed of
        -1 means unseeded, as in llama.cpp."""
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {value!r}")
        for name, limit in (("top_k", MAX_TOP_K), ("repeat_last_n", MAX_TOP_K), ("seed", SEED_LIMIT)):
            value = getattr(self, name)
            if name == "seed" and value in (None, -1):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
                raise RequestError(f"{name} must be an integer in [0, {limit}), got {value!r}")
        checks = [(self.temperature >= 0, "temperature must be >= 0"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"), (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                  (self.repeat_penalty > 0, "repeat_penalty must be > 0"),
                  (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
                  (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]")]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)
        return self


def apply_repeat_penalty(logits: np.ndarray, history: list[int], penalty: float) -> np.ndarray:
    """Seen tokens: positive logits divided by the penalty, negative ones multiplied (as llama.cpp/HF)."""
    if penalty == 1.0 or not history:
        return logits
    seen = np.unique(np.asarray(history, np.int64))
    out = logits.copy()
    out[seen] = np.where(out[seen] > 0, out[seen] / penalty, out[seen] * penalty)
    return out


def apply_openai_penalties(logits: np.ndarray, generated: list[int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's: subtract `frequency` per earlier occurrence and `presence` once, over generated tokens."""
    if not generated or presence == frequency == 0:
        return logits
    ids, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
    out = logits.copy()
    out[ids] -= frequency * counts + presence
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.size:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits >= kth, logits, -np.inf)


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The indices `top_k_filter` keeps, in order. Filtered tokens weigh nothing in what follows, so
    top-p, min-p and the draw (one uniform against the cumulative sum, in token order) may run over
    these alone: the same choice, without sorting the whole vocabulary every token."""
    if k <= 0 or k >= logits.size:
        return np.arange(logits.size)
    return np.flatnonzero(logits >= np.partition(logits, -k)[-k])


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    cumulative = np.cumsum(softmax(logits)[order])
    keep = order[: int(np.searchsorted(cumulative, p)) + 1]
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is below min_p times the top token's."""
    if min_p <= 0:
        return logits
    probs = softmax(logits)
    return np.where(probs >= min_p * probs.max(), logits, -np.inf)


def choose(logits: np.ndarray, row) -> int:
    """One token from penalized logits and a row (temperature, top_k, top_p, min_p, u): the draw is
    numpy's Generator.choice with u as its uniform (the first token, in token order, whose share of
    the cumulative probability exceeds u)."""
    temperature, top_k, top_p, min_p, u = (float(v) for v in row)
    if temperature == 0:
        return int(np.argmax(logits))
    logits = np.asarray(logits, np.float64) / temperature
    ids = top_k_ids(logits, int(top_k))          # the later stages and the draw see only top-k's survivors
    cdf = np.cumsum(softmax(min_p_filter(top_p_filter(logits[ids], top_p), min_p)))
    return int(ids[np.searchsorted(cdf / cdf[-1], u, side="right")])


def greedy_rows(n: int) -> np.ndarray:
    """n rows for `choose` (or the `sample` op) that take the most likely token: temperature 0."""
    return np.zeros((n, 5), np.float32)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.rng = np.random.default_rng(None if params.seed == -1 else params.seed)

    def draw(self) -> np.ndarray:
        """The next choice's row for `choose` (or the `sample` op): one uniform per sampled token."""
        p = self.params
        u = min(self.rng.random(), LAST_BELOW_ONE) if p.temperature > 0 else 0.0     # kept < 1 once in f32
        return np.array([p.temperature, p.top_k, p.top_p, p.min_p, u], np.float32)

    def __call__(self, logits: np.ndarray, history: list[int], generated: list[int] = ()) -> int:
        p = self.params
        logits = apply_repeat_penalty(np.asarray(logits, np.float64), history[-p.repeat_last_n:] if p.repeat_last_n else history,
                                      p.repeat_penalty)
        logits = apply_openai_penalties(logits, generated, p.presence_penalty, p.frequency_penalty)
        return choose(logits, self.draw())

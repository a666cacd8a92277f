"""The sampling pipeline, in SPEC order: repetition penalty (and OpenAI's presence/frequency
penalties over the generated tokens) -> temperature -> top-k -> top-p -> min-p -> draw.
Temperature 0 is greedy.

The repetition penalty is llama.cpp's `repeat_penalty` (transformers' `repetition_penalty`): the logit of
every token seen in the window is divided by it where positive, multiplied by it where not. The window is
llama.cpp's `repeat_last_n`: the last n tokens of prompt and reply together (64 by default, as llama.cpp's
server and CLI, which feed the prompt to their sampler), 0 for none, -1 for the whole sequence (what
transformers penalizes).

SPEC's presets (router, code, reasoning, creative) are named sets of these parameters; a request's own
values override a preset's.

After the penalties, a choice is `choose(logits, row)` (ir/sampling.py) with row = (temperature,
top_k, top_p, min_p, u), u the step's uniform: the decoder graph's `sample` op takes the same rows,
so a stream without penalties or logprobs is sampled where the model runs, and only its token comes back."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from soma_runtime.errors import RequestError
from soma_runtime.ir.sampling import choose, draw, probabilities

MAX_TOP_K = 2**31            # top_k and repeat_last_n: at most a vocabulary's (or a context's) size
WHOLE_SEQUENCE = -1         # repeat_last_n: the window is every token so far
PRESETS = {
    "router": {"temperature": 0.0, "seed": 42},
    "code": {"temperature": 0.0, "top_p": 0.5, "seed": 42},
    "reasoning": {"temperature": 0.7, "min_p": 0.05},
    "creative": {"temperature": 1.0, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.2},
}
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
            if (name == "seed" and value in (None, -1)) or (name == "repeat_last_n" and value == WHOLE_SEQUENCE):
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


def sampling_preset(name: str) -> dict:
    """A preset's parameters (SPEC "inference parameters"); RequestError for a name that is none."""
    if not isinstance(name, str) or name not in PRESETS:
        raise RequestError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return dict(PRESETS[name])


def repeat_window(history: list[int], last_n: int) -> list[int]:
    """The tokens the repetition penalty looks at: the last `last_n` (0: none, -1: all)."""
    if last_n == WHOLE_SEQUENCE:
        return history
    return history[-last_n:] if last_n else []


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

    def penalize(self, logits: np.ndarray, history: list[int], generated: list[int]) -> np.ndarray:
        """The logits after the repetition, presence and frequency penalties."""
        p = self.params
        if not p.penalized:
            return logits
        logits = apply_repeat_penalty(np.asarray(logits, np.float64), repeat_window(history, p.repeat_last_n),
                                      p.repeat_penalty)
        return apply_openai_penalties(logits, generated, p.presence_penalty, p.frequency_penalty)

    def __call__(self, logits: np.ndarray, history: list[int], generated: list[int] = (), allowed=None) -> int:
        """The next token; `allowed` (ascending token ids, a grammar's) keeps the choice to those tokens: the
        pipeline runs over them alone (in token order, so the draw is the one the masked vocabulary gives)."""
        logits = self.penalize(logits, history, generated)
        if allowed is None:
            return choose(logits, self.draw())
        return int(allowed[choose(np.asarray(logits)[allowed], self.draw())])

    def verify(self, logits: np.ndarray, draft: int, history: list[int], generated: list[int] = ()) -> int:
        """The next token where a drafter proposed `draft` (a single token): greedy takes the most likely one
        (the draft survives when it is that); sampling keeps the draft with its probability p(draft), else
        draws from p without it, renormalized: the token is distributed exactly as p (speculative sampling)."""
        if self.params.temperature == 0:
            return self(logits, history, generated)
        row = self.draw()
        ids, probs = probabilities(self.penalize(logits, history, generated), row)
        at = np.searchsorted(ids, draft)
        if at < len(ids) and ids[at] == draft:
            if row[4] < probs[at]:
                return draft
            probs = probs.copy()
            probs[at] = 0.0
        return draw(ids, probs, min(self.rng.random(), LAST_BELOW_ONE))

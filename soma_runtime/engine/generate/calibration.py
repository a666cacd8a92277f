"""A fixed text an engine runs once, with a float cache, where a KV codec needs to know the model's keys:
each layer's mean key, the center rotated codecs code keys about (PagedKV.key_center); and where the
memory ladder needs to know which compressed kinds keep this model's answers: each candidate's next-token
distributions over the text against the float cache's. Prose, code, a question and its answer, another
language and numbers, so neither is one genre's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TEXT = """The library opens at nine in the morning and closes at six in the evening, except on public holidays.
Visitors may borrow up to five books at a time for three weeks; a renewal can be requested online or at
the front desk. In 1998 the city council voted to expand the building, adding a reading room, a small
cafe and a collection of maps that date back to the seventeenth century.

def average(values):
    \"\"\"Return the arithmetic mean of a non-empty list of numbers.\"\"\"
    return sum(values) / len(values)

Question: What is the capital of France, and why did it become the centre of the country?
Answer: Paris. It grew around an island in the Seine, where trade routes crossed, and the kings who
ruled from it gradually extended their power over the surrounding regions.

Il pleut depuis ce matin, mais nous irons quand même au marché acheter des légumes et du pain.
The experiment measured a temperature of 23.5 degrees, a pressure of 101.3 kPa and a humidity of 40%.
"""


def mean_keys(pool, seq, layers: int) -> tuple[np.ndarray, ...]:
    """Each layer's mean key [kv_heads, head_dim] over the tokens `seq` holds in `pool` (a float cache:
    its pages hold the keys as the model gives them, rope applied)."""
    means = []
    for layer in range(layers):
        backend = pool.backend_of(layer)
        keys = np.asarray(backend.fetch(pool.k[layer][seq.pages]), np.float32)
        means.append(keys.reshape(-1, *keys.shape[2:])[:seq.length].mean(axis=0))
    return tuple(means)


# The memory ladder's kinds, largest first, and the bar each must pass on the model at hand: the mean KL
# divergence (nats a token) of its next-token distributions over TEXT from the float cache's, both with f32
# activations (q8 activations would add their own rounding noise to both).
LADDER = ("kv4", "tq4", "kv3", "tq3")
QUALITY_BAR = 0.01


@dataclass(frozen=True)
class KindQuality:
    kind: str
    divergence: float          # mean KL(float cache || kind) a token, nats
    agreement: float           # the fraction of positions whose most likely next token is the float cache's

    @property
    def passes(self) -> bool:
        return self.divergence <= QUALITY_BAR


def divergence(reference: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """Mean KL(reference || logits) a row, and the fraction of rows whose top tokens agree."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    p, q = log_softmax(reference), log_softmax(logits)
    kl = float(np.mean(np.sum(np.exp(p) * (p - q), axis=1)))
    return kl, float(np.mean(reference.argmax(axis=1) == logits.argmax(axis=1)))

"""The `sample` op's arithmetic for one row on the host: temperature -> top-k -> top-p -> min-p ->
the draw. The CPU backend's jet and the engine's host sampler (after its penalties) share it, so a
stream draws the same token wherever it is sampled. Each stage is a small function over a logits vector."""
from __future__ import annotations

import numpy as np


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


def probabilities(logits: np.ndarray, row) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a sampled row (temperature > 0) may draw and their probabilities, in token order."""
    temperature, top_k, top_p, min_p, _ = (float(v) for v in row)
    logits = np.asarray(logits, np.float64) / temperature
    ids = top_k_ids(logits, int(top_k))          # the later stages and the draw see only top-k's survivors
    return ids, softmax(min_p_filter(top_p_filter(logits[ids], top_p), min_p))


def draw(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    """numpy's Generator.choice with u as its uniform: the first token, in token order, whose share of the
    cumulative probability exceeds u."""
    cdf = np.cumsum(probs)
    return int(ids[np.searchsorted(cdf / cdf[-1], u, side="right")])


def choose(logits: np.ndarray, row) -> int:
    """One token from penalized logits and a row (temperature, top_k, top_p, min_p, u)."""
    if float(row[0]) == 0:
        return int(np.argmax(logits))
    return draw(*probabilities(logits, row), float(row[4]))

"""llama.cpp as the greedy-decoding reference, with the float noise it shows against itself.

llama.cpp does not agree with itself to the last bit: the same tokens evaluated one at a time (as
it generates) and as one batch give logits that differ by float rounding, more on some CPUs than
others (its SIMD paths sum in different orders). Where its own two evaluations put the top two
tokens closer than that, the choice between them is a tie, and another engine may break it either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOOR = 0.25          # the smallest gap ever called a tie (a quiet reference still rounds differently from us)
CEILING = 1.0         # self-disagreement beyond this is no longer rounding: the reference run is broken


@dataclass
class Greedy:
    tokens: list[int]
    gaps: np.ndarray          # llama.cpp's top-2 logit gap at each step, as it generated
    noise: float              # how far its batched evaluation moves those gaps, at most


def top2_gaps(logits: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """logits[i, first] - logits[i, second] for each row's (first, second) token pair."""
    return np.take_along_axis(logits, pairs[:, :1], 1)[:, 0] - np.take_along_axis(logits, pairs[:, 1:], 1)[:, 0]


def llama_greedy(llama, ids: list[int], n: int) -> Greedy:
    """llama.cpp's greedy continuation of `ids` (up to n tokens or its end of text), with its logits
    step by step and then all tokens again as one batch."""
    llama.reset()
    tokens = []
    for t in llama.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, top_p=1.0, min_p=0.0):
        tokens.append(t)
        if len(tokens) == n or t == llama.token_eos():
            break
    rows = slice(len(ids) - 1, len(ids) + len(tokens) - 1)
    stepped = np.array(llama.scores[rows])
    llama.reset()
    llama.eval(ids + tokens)
    batched = np.array(llama.scores[rows])
    pairs = np.argsort(stepped, axis=1)[:, [-1, -2]]
    gaps = top2_gaps(stepped, pairs)
    return Greedy(tokens, gaps, float(np.abs(gaps - top2_gaps(batched, pairs)).max()))


def near_tie(runs: list[Greedy]) -> float:
    """The gap below which a greedy choice is a tie: llama.cpp's own largest disagreement over these runs."""
    noise = max(run.noise for run in runs)
    assert noise < CEILING, f"llama.cpp's stepped and batched logits disagree by {noise:.3f}: not float noise"
    return max(FLOOR, noise)


def first_difference(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def check_greedy(label: str, got: list[int], want: Greedy, tie: float) -> int:
    """How many leading tokens agree; fails where they part at a gap llama.cpp is clear about."""
    first = first_difference(got, want.tokens)
    print(f"{label}: {len(want.tokens) if first is None else first} of {len(want.tokens)} greedy tokens identical to llama.cpp")
    assert first is None or want.gaps[first] < tie, \
        f"{label}: differs at token {first} where llama.cpp's top-2 gap is a clear {want.gaps[first]:.3f} (ties below {tie:.3f})"
    return len(want.tokens) if first is None else first

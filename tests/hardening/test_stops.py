"""Stop strings: the automaton cuts a stream exactly where a plain search of the whole text would, holds
back only what could still become a stop, and refuses stop lists past their limits."""
from __future__ import annotations

import random

import pytest

from soma_runtime.engine.generate.stops import MAX_STOP_CHARS, MAX_STOPS, StopMatcher, check_stops
from soma_runtime.errors import RequestError


def searched(text: str, stops: list[str]) -> tuple[str, bool]:
    """The reference: the text before the stop that ends first (the longest of those ending there)."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s and s in text]
    if not ends:
        return text, False
    end, minus = min(ends)
    return text[: end + minus], True


def fed(text: str, stops: list[str], cuts: list[int]) -> tuple[str, bool, list[str]]:
    matcher, out, pieces = StopMatcher(stops), "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        piece, stopped = matcher.push(text[a:b])
        pieces.append(piece)
        out += piece
        if stopped:
            return out, True, pieces
    return out + matcher.flush(), False, pieces


@pytest.mark.parametrize("trial", range(300))
def test_streamed_stops_cut_where_a_search_of_the_whole_text_does(trial):
    rng = random.Random(trial)
    alphabet = "abc \n"[: rng.randint(2, 5)]
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
    got, stopped, pieces = fed(text, stops, cuts)
    assert (got, stopped) == searched(text, stops)
    let_out = ""
    for piece in pieces:                        # text is let out only once no stop can begin in it
        let_out += piece
        assert searched(let_out, stops)[0] == let_out or stopped


def test_text_that_may_begin_a_stop_is_held_back():
    matcher = StopMatcher(["</answer>"])
    assert matcher.push("42 </ans") == ("42 ", False)
    assert matcher.push("wer> more") == ("", True)
    matcher = StopMatcher(["</answer>"])
    assert matcher.push("a </ans") == ("a ", False)
    assert matcher.push("x") == ("</ansx", False)


@pytest.mark.parametrize("stops, needle", [
    (["x"] * (MAX_STOPS + 1), f"at most {MAX_STOPS}"),
    (["y" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS}"),
    ([5], "strings"),
    ("not a list", "strings"),
])
def test_stop_lists_past_their_limits_are_refused(stops, needle):
    with pytest.raises(RequestError, match=needle):
        check_stops(stops)

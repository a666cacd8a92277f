"""Stop strings: a stream's text is cut at the first stop that appears in it, and text that could
still become a stop is held back until it no longer can.

The stops are one Aho-Corasick automaton, fed each character once: the scheduler's thread, which every
stream shares, spends time linear in the text whatever the stops are. Counts and lengths are bounded.
"""
from __future__ import annotations

from collections import deque

from soma_runtime.errors import RequestError

MAX_STOPS = 16
MAX_STOP_CHARS = 256


def check_stops(stops) -> None:
    """RequestError for stops that are not a list of at most MAX_STOPS strings of at most MAX_STOP_CHARS."""
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise RequestError(f"stop may hold at most {MAX_STOPS} strings, got {len(stops)}")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise RequestError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}")


class StopMatcher:
    """Feeds text through the stops' automaton. A state is the longest end of the text so far that
    begins some stop: exactly what must be held back."""

    def __init__(self, stops: list[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]          # characters a state stands for
        self.found = [0]          # the longest stop ending at a state (0: none)
        for stop in filter(None, stops):
            state = 0
            for char in stop:
                if char not in self.goto[state]:
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.found.append(0)
                    self.goto[state][char] = len(self.goto) - 1
                state = self.goto[state][char]
            self.found[state] = len(stop)
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())
        while queue:                                   # breadth first: a state's fallback is shallower
            state = queue.popleft()
            for char, child in self.goto[state].items():
                back = self.fail[state]
                while back and char not in self.goto[back]:
                    back = self.fail[back]
                self.fail[child] = self.goto[back].get(char, 0) if self.goto[back].get(char) != child else 0
                self.found[child] = max(self.found[child], self.found[self.fail[child]])
                queue.append(child)
        self.state, self.held = 0, ""

    def push(self, text: str) -> tuple[str, bool]:
        """The text that can be let out, and whether a stop was reached (the text then ends before it)."""
        if len(self.goto) == 1:
            return text, False
        goto, fail, state = self.goto, self.fail, self.state
        for i, char in enumerate(text):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            if self.found[state]:
                out = self.held + text[: i + 1]
                self.state, self.held = 0, ""
                return out[: len(out) - self.found[state]], True
        self.state = state
        out = self.held + text
        keep = len(out) - self.depth[state]
        out, self.held = out[:keep], out[keep:]
        return out, False

    def flush(self) -> str:
        out, self.held, self.state = self.held, "", 0
        return out

"""The Python API checks what it is given where it is given: a wrong type or an out-of-range value is a
RequestError naming the argument, raised before any forward runs, and the model goes on serving."""
from __future__ import annotations

import io
import sys
import time

import numpy as np
import pytest

from soma_runtime.errors import RequestError


@pytest.mark.parametrize("call, needle", [
    (lambda m: m.generate([1, 2, 10**9]), "token ids must be in"),
    (lambda m: m.generate([1, -3]), "token ids must be in"),
    (lambda m: m.generate([1, 2.5]), "integers"),
    (lambda m: m.generate([1, True]), "integers"),
    (lambda m: m.generate(np.array([1.0, 2.0])), "integers"),
    (lambda m: m.generate(b"bytes"), "prompt must be text"),
    (lambda m: m.generate([]), "non-empty"),
    (lambda m: m.generate("hi", max_tokens=True), "max_tokens"),
    (lambda m: m.generate("hi", max_tokens=2.5), "max_tokens"),
    (lambda m: m.generate("hi", max_tokens="10"), "max_tokens"),
    (lambda m: m.generate("hi", temperature="hot"), "temperature"),
    (lambda m: m.generate("hi", temperature=float("nan")), "temperature"),
    (lambda m: m.generate("hi", top_k=1e40), "top_k"),
    (lambda m: m.generate("hi", top_k=2.5), "top_k"),
    (lambda m: m.generate("hi", seed=-7), "seed"),
    (lambda m: m.generate("hi", seed=2**64), "seed"),
    (lambda m: m.generate("hi", stop=5), "stop"),
    (lambda m: m.generate("hi", stop=["a"] * 100), "stop"),
    (lambda m: m.generate("\ud800"), "Unicode"),
    (lambda m: m.request([1, 2], 4, logprobs=99), "logprobs"),
    (lambda m: m.request([1, 2], 4, logprobs=1.5), "logprobs"),
    (lambda m: m.logits([1, 10**9]), "token ids"),
    (lambda m: m.chat("not a list"), "messages"),
    (lambda m: m.chat([{"role": "wizard", "content": "hi"}]), "role"),
])
def test_bad_arguments_are_request_errors_naming_them(smol, call, needle):
    with pytest.raises(RequestError, match=needle):
        result = call(smol)
        if hasattr(result, "__next__"):
            next(result)
    assert smol.engine.pool.in_use == 0
    assert len(list(smol.generate("Hello", max_tokens=2, temperature=0))) == 2


def test_numpy_token_ids_are_taken_as_ids(smol):
    ids = smol.tokenize("The capital of France is")
    expected = [t.id for t in smol.generate(ids, max_tokens=4, temperature=0)]
    assert [t.id for t in smol.generate(np.asarray(ids, np.int32), max_tokens=4, temperature=0)] == expected


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def rendered(text: str) -> list[str]:
    """The lines a terminal shows: each carriage return goes back to the line's start and overwrites."""
    lines = []
    for line in text.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown.rstrip())
    return lines


@pytest.mark.parametrize("tty", [False, True])
def test_an_error_prints_on_its_own_line_not_the_progress_bars(monkeypatch, tty):
    """A load that fails after its progress bar has been drawn: the error shows on a line of its own,
    and where stderr is no terminal (a log, a pipe) no bar is drawn at all."""
    from soma_runtime import loaders
    from soma_runtime.cli.main import main
    from soma_runtime.errors import ModelLoadError
    from soma_runtime.tasks import text
    real = loaders.load

    def slow(*args, **kwargs):
        time.sleep(0.8)                               # past the bar's delay: the next update draws it
        return real(*args, **kwargs)

    def broken(*args, **kwargs):
        raise ModelLoadError("the graph could not be built")
    stderr = Stream(tty)
    monkeypatch.setattr(loaders, "load", slow)
    monkeypatch.setattr(text, "Engine", broken)
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main(["run", "--prompt", "hi"]) == 1
    text = stderr.getvalue()
    assert ("loading" in text) == tty, repr(text)
    lines = [line for line in rendered(text) if "error:" in line]
    assert lines == ["soma-runtime: error: the graph could not be built"], repr(text)
    if not tty:
        assert "\r" not in text

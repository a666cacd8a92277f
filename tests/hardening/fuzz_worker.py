"""The fuzz tests' workers: each runs the cases a test made in a process whose address space is capped,
under a hang guard, and prints one JSON line per case ({case, outcome, detail, seconds}). This module is
also the loaders' worker: `python -m tests.hardening.fuzz_worker CAP_BYTES PATH...` loads each model."""
from __future__ import annotations

import json
import resource
import signal
import sys
import time
from collections.abc import Callable

HANG_SECONDS = 20        # a case still running after this is reported as hung (the test's guard, not a speed target)


class Hung(BaseException):       # not an Exception: no handler for a refusal may swallow it
    pass


def on_alarm(signum, frame):
    raise Hung()


def capped(cap: int) -> None:
    """Caps this process's address space at what it maps now plus `cap`, and arms the hang guard."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + cap, mapped + cap))
    signal.signal(signal.SIGALRM, on_alarm)


def report(case: str, attempt: Callable[[str], tuple[str, str]], typed: tuple[type[Exception], ...] = (),
           seconds: int = HANG_SECONDS) -> None:
    """Runs `attempt(case)` and prints its line: the (outcome, detail) it returns, the name of the `typed`
    error it raised (the first listed it is an instance of), "hung", or any other exception's name."""
    start = time.perf_counter()
    signal.alarm(seconds)
    try:
        outcome, detail = attempt(case)
    except typed as e:
        outcome, detail = next(t.__name__ for t in typed if isinstance(e, t)), str(e)[:300]
    except Hung:
        outcome, detail = "hung", ""
    except Exception as e:                            # noqa: BLE001  (what the tests look for: reported, never hidden)
        outcome, detail = type(e).__name__, str(e)[:300]
    finally:
        signal.alarm(0)
    print(json.dumps({"case": case, "outcome": outcome, "detail": detail, "seconds": time.perf_counter() - start}),
          flush=True)


def main(cap: int, paths: list[str]) -> None:
    from soma_runtime.errors import ModelLoadError
    from soma_runtime.tasks import Runtime
    capped(cap)
    runtime = Runtime(threads=1)

    def load(path: str) -> tuple[str, str]:
        try:
            runtime.load(path, progress=False, model_id="fuzzed")
        finally:
            runtime.models.clear()
        return "loaded", ""
    for path in paths:
        report(path, load, (ModelLoadError,))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])

"""Loads each model a fuzz test made, under an address-space cap, and prints one JSON line per model:
what the load ended in, how long it took and how much memory it took. Run as
`python -m tests.hardening.fuzz_worker CAP_BYTES PATH...` from the repository root."""
from __future__ import annotations

import json
import resource
import signal
import sys
import time

HANG_SECONDS = 20        # a load still running after this is reported as hung (the test's guard, not a speed target)


class Hung(Exception):
    pass


def on_alarm(signum, frame):
    raise Hung()


def main(cap: int, paths: list[str]) -> None:
    from soma_runtime.api import Runtime
    from soma_runtime.errors import ModelLoadError
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + cap, mapped + cap))
    signal.signal(signal.SIGALRM, on_alarm)
    runtime = Runtime(threads=1)
    for path in paths:
        start, outcome = time.perf_counter(), "loaded"
        signal.alarm(HANG_SECONDS)
        try:
            model = runtime.load(path, progress=False, model_id="fuzzed")
            del model
            runtime.models.clear()
        except ModelLoadError:
            outcome = "ModelLoadError"
        except Hung:
            outcome = "hung"
        except Exception as e:                        # noqa: BLE001  (what the test looks for: reported, never hidden)
            outcome = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            signal.alarm(0)
        print(json.dumps({"path": path, "outcome": outcome, "seconds": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])

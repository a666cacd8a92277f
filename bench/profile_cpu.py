"""Where a CPU decode step's time goes: the numba kernels (each timed at its call from Python) against
the step's wall time, so the share spent outside kernels (plan loop, jet wrappers, numpy glue) is
measured, not guessed. Greedy decode of the bundled SmolLM2 (or --model), a 128-token prompt.

Run: python bench/profile_cpu.py [--model PATH] [--threads 2] [--tokens 64]
"""
from __future__ import annotations

import argparse
import collections
import importlib
import pkgutil
import time

from numba.core.registry import CPUDispatcher

import soma_runtime.backends.cpu as cpu_backend

PROMPT_TOKENS = 128


class Timed:
    """A kernel that adds its wall time to `totals` under its name."""

    def __init__(self, kernel, totals: dict):
        self.kernel, self.totals, self.name = kernel, totals, kernel.py_func.__qualname__

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.kernel(*args, **kwargs)
        finally:
            entry = self.totals[self.name]
            entry[0] += time.perf_counter() - start
            entry[1] += 1


def time_kernels(totals: dict) -> None:
    """Every numba kernel the CPU backend's modules call from Python, wrapped (module globals and the
    kernel tables they keep); calls from one kernel into another stay inside the compiled code."""
    wrapped = {}
    wrap = lambda k: wrapped.setdefault(id(k), Timed(k, totals))
    for info in pkgutil.iter_modules(cpu_backend.__path__):
        module = importlib.import_module(f"{cpu_backend.__name__}.{info.name}")
        for name, value in list(vars(module).items()):
            if isinstance(value, CPUDispatcher):
                setattr(module, name, wrap(value))
            elif isinstance(value, dict) and value and all(isinstance(v, CPUDispatcher) for v in value.values()):
                value.update({key: wrap(k) for key, k in value.items()})


def decode_seconds(model, prompt: list[int], tokens: int) -> float:
    start = time.perf_counter()
    for i, _ in enumerate(model.generate(prompt, max_tokens=tokens + 1, temperature=0)):
        if i == 0:
            start = time.perf_counter()              # the prompt's step excluded
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from soma_runtime.tasks import Runtime
    model = Runtime("cpu", threads=args.threads).load(args.model, progress=False)
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    decode_seconds(model, prompt, 8)                    # warm-up: kernels loaded, plans made
    plain = decode_seconds(model, prompt, args.tokens)
    totals = collections.defaultdict(lambda: [0.0, 0])
    time_kernels(totals)
    decode_seconds(model, prompt, 8)
    totals.clear()
    timed = decode_seconds(model, prompt, args.tokens)
    inside = sum(t for t, _ in totals.values())
    steps = len(model.engine.plan(1).steps)
    print(f"decode: {args.tokens / plain:.1f} tok/s, {plain / args.tokens * 1e3:.2f} ms a token "
          f"({timed / args.tokens * 1e3:.2f} ms with kernels timed), {steps} plan steps a token")
    per_token = 1e3 / args.tokens
    print(f"in numba kernels: {inside * per_token:.2f} ms a token; outside: {(timed - inside) * per_token:.2f} ms "
          f"({(timed - inside) / timed * 100:.0f}% of the step)")
    for name, (seconds, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  {seconds / args.tokens * 1e6:9.1f} us  {calls / args.tokens:6.1f}x  {name}")


if __name__ == "__main__":
    main()

"""A plan's steps as one generated Python function: each step a line that calls its kernel.

The loop a plan would otherwise run per step (its inputs looked up in a dict by name, its attributes
unpacked, its results stored back by name) becomes straight-line code over local variables; constants,
views fixed at planning, kernels, arena buffers and attributes are the function's globals, bound once.
A value no later step reads is deleted after its last reader, as the loop does. Only plans whose
sizes are all known before they run are compiled (a size the data decides rebinds attributes per run).
Knows steps (kernel, input and output names, attrs, the arena view written); nothing of ops or graphs.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

FILENAME = "<plan>"          # the generated code's name in tracebacks: a failing line names its step


@dataclass(frozen=True)
class Compiled:
    """`run(inputs)` -> the outputs in order; `line_steps`: the index of the step each line of the source runs."""
    run: Callable[[dict], list]
    line_steps: dict[int, int]
    source: str

    def failing_step(self, tb) -> int | None:
        """The index of the step whose line raised, read off a traceback through the generated function."""
        step = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == FILENAME:
                step = self.line_steps.get(tb.tb_lineno)
            tb = tb.tb_next
        return step


def compile_steps(steps: Sequence, dead: Sequence[tuple[str, ...]], bound: dict, inputs: Sequence[str],
                  outputs: Sequence[str]) -> Compiled:
    """`steps` (kernel, inputs, outputs, attrs, out) run in order; `dead[k]`: names no step after k reads;
    `bound`: values known when the plan is made (constants, fixed views), by name; `inputs`: the names a
    run gives; `outputs`: the names it returns."""
    local: dict[str, str] = {}
    fresh = (f"v{i}" for i in itertools.count())
    scope: dict[str, object] = {}

    def name_of(tensor: str) -> str:
        if tensor not in local:
            local[tensor] = next(fresh)
            if tensor in bound:
                scope[local[tensor]] = bound[tensor]
        return local[tensor]

    lines = ["def run(inputs):"]
    lines += [f"    {name_of(name)} = inputs[{name!r}]" for name in inputs]
    line_steps = {}
    for k, step in enumerate(steps):
        scope[f"k{k}"] = step.kernel
        args = [("None" if name is None else name_of(name)) for name in step.inputs]
        if step.out is not None:
            scope[f"o{k}"] = step.out
            args.append(f"out=o{k}")
        if step.attrs:
            scope[f"a{k}"] = step.attrs
            args.append(f"**a{k}")
        call = f"k{k}({', '.join(args)})"
        results = [name_of(name) for name in step.outputs]
        first = len(lines)
        if step.out is not None:             # a kernel that made its result elsewhere: copied into the arena
            lines.append(f"    r = {call}")
            lines.append(f"    if r is not o{k}: o{k}[...] = r; r = o{k}")
        else:
            lines.append(f"    r = {call}")
        if len(results) == 1:
            lines.append(f"    {results[0]} = r")
        else:
            lines += [f"    {result} = r[{i}]" for i, result in enumerate(results)]
        gone = [local[name] for name in dead[k] if name in local and name not in bound]
        if gone:
            lines.append(f"    del {', '.join(gone)}")
        line_steps.update(dict.fromkeys(range(first + 1, len(lines) + 1), k))
    lines.append(f"    return [{', '.join(name_of(name) for name in outputs)}]")
    source = "\n".join(lines) + "\n"
    exec(compile(source, FILENAME, "exec"), scope)        # noqa: S102  (our own text: names are generated, tensor names quoted)
    return Compiled(scope["run"], line_steps, source)

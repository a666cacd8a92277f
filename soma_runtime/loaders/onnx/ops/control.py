"""Control flow, unrolled: an If whose condition is known at conversion becomes the branch it takes; a
Scan or a Loop whose length is known becomes its body converted once per step (a length that only the
data decides makes the model a GraphFamily, converted per input)."""
from __future__ import annotations

import numpy as np

from soma_runtime.loaders.onnx.fold import SymbolicError
from soma_runtime.loaders.onnx.ops.layout import joined, reshape_to
from soma_runtime.loaders.onnx.ops.table import onnx_op

MAX_STEPS = 4096                 # an unrolled loop longer than this is refused, not built


def stacked(cv, steps: list, axis: int):
    """Per-step tensors joined along a new axis."""
    parts = []
    for y in steps:
        dims = list(cv.meta(y).shape)
        dims.insert(cv.axis(axis, len(dims) + 1), 1)
        parts.append(reshape_to(cv, y, dims))
    return joined(cv, parts, axis)


def step_count(cv, n: int) -> int:
    if not isinstance(n, int):
        raise SymbolicError(f"its length {n} is not known before the inputs' sizes are")
    if n > MAX_STEPS:
        raise cv.unsupported(f"{n} steps: more than the {MAX_STEPS} a loop is unrolled to")
    return n


@onnx_op("If")
def if_(cv, n):
    cond = cv.known(n.inputs[0], "condition")
    branch = n.attr("then_branch") if bool(np.asarray(cond).reshape(-1)[0]) else n.attr("else_branch")
    return cv.call(branch)


def scanned(cv, body, states: list, xs: list, axes: list, reverse: list) -> tuple[list, list[list]]:
    """The body run once per slice of the scan inputs along their `axes` (from the end where `reverse`): the
    final states, and each step's scan outputs."""
    length = step_count(cv, cv.meta(xs[0]).shape[axes[0]])
    outputs: list[list] = []
    for t in range(length):
        slices = [cv.emit("take", x, np.array(length - 1 - t if rev else t, np.int64), axis=axis)
                  for x, axis, rev in zip(xs, axes, reverse)]
        results = cv.call(body, states + slices)
        states, ys = results[:len(states)], results[len(states):]
        outputs.append(ys)
    return states, outputs


@onnx_op("Scan")
def scan(cv, n):
    """States carried through the body, which also reads one slice of each scan input per step and writes one
    slice of each scan output. Opset 8 scans axis 1 of inputs batched on axis 0 (each batch item scanned on
    its own; sequence_lens, where given, must be every item's full length); opset 9 on, the axes given."""
    body, m = n.attr("body"), n.attr("num_scan_inputs")
    if n.opset < 9:
        return scan_batched(cv, n, body, m)
    states, xs = list(n.inputs[:len(n.inputs) - m]), n.inputs[len(n.inputs) - m:]
    in_axes = [cv.axis(a, cv.meta(x).ndim) for a, x in zip(n.attr("scan_input_axes", [0] * m), xs)]
    states, outputs = scanned(cv, body, states, xs, in_axes, n.attr("scan_input_directions", [0] * m))
    k = len(outputs[0]) if outputs else 0
    out_axes, out_reverse = n.attr("scan_output_axes", [0] * k), n.attr("scan_output_directions", [0] * k)
    scans = []
    for j in range(k):
        steps = [ys[j] for ys in outputs]
        scans.append(stacked(cv, steps[::-1] if out_reverse[j] else steps, out_axes[j]))
    return states + scans


def scan_batched(cv, n, body, m: int) -> list:
    """Scan-8: each batch item's states and scan inputs scanned on their own, the results stacked on axis 0."""
    lengths, states, xs = n.inputs[0], list(n.inputs[1:len(n.inputs) - m]), n.inputs[len(n.inputs) - m:]
    batch, length = cv.meta(xs[0]).shape[:2]
    if not isinstance(batch, int):
        raise SymbolicError(f"its batch {batch} is not known before the inputs' sizes are")
    if lengths is not None and np.any(np.asarray(cv.known(lengths, "sequence lengths")) != length):
        raise cv.unsupported(f"sequence lengths {np.asarray(lengths).tolist()} other than the full {length}")
    finals, scans = [], []
    for b in range(batch):
        index = np.array(b, np.int64)
        item_states, outputs = scanned(cv, body, [cv.emit("take", s, index, axis=0) for s in states],
                                       [cv.emit("take", x, index, axis=0) for x in xs], [0] * m,
                                       n.attr("directions", [0] * m))
        finals.append(item_states)
        scans.append([stacked(cv, [ys[j] for ys in outputs], 0) for j in range(len(outputs[0]) if outputs else 0)])
    return [stacked(cv, [f[i] for f in finals], 0) for i in range(len(states))] + \
        [stacked(cv, [s[j] for s in scans], 0) for j in range(len(scans[0]))]


@onnx_op("Loop", sequences=True)
def loop(cv, n):
    """Runs while the trip count and the condition allow; both must be known at every step."""
    trip = cv.known(n.input(0), "trip count")
    cond = cv.known(n.input(1), "condition")
    if trip is not None and np.asarray(trip).dtype == object:
        raise SymbolicError(f"its trip count {np.asarray(trip).reshape(-1)[0]} is not known before the inputs' sizes are")
    limit = MAX_STEPS + 1 if trip is None else int(np.asarray(trip).reshape(-1)[0])
    going = True if cond is None else bool(np.asarray(cond).reshape(-1)[0])
    states, outputs, i = list(n.inputs[2:]), [], 0
    while going and i < limit:
        step_count(cv, i + 1)
        results = cv.call(n.attr("body"), [np.array(i, np.int64), np.array(going)] + states)
        going = bool(np.asarray(cv.known(results[0], "loop condition")).reshape(-1)[0])
        states, ys = results[1:1 + len(states)], results[1 + len(states):]
        outputs.append(ys)
        i += 1
    if not outputs:
        raise cv.unsupported("a loop that runs no step (its scan outputs would be empty) is not supported")
    return states + [stacked(cv, [ys[j] for ys in outputs], 0) for j in range(len(outputs[0]))]

"""Sequences of tensors, resolved at import: no sequence reaches the IR. A sequence whose length and positions
the graph settles (torch's exports of lists: SplitToSequence or SequenceConstruct, SequenceAt at a known
position, SequenceInsert in an unrolled Loop, ConcatFromSequence) is, while the graph converts, a tuple of
its tensors. A position or a split only the data decides, a sequence as the graph's input or output, and any
other op given one are UnsupportedModelErrors naming the node."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from soma_runtime.loaders.onnx.fold import SymbolicError
from soma_runtime.loaders.onnx.ops.control import stacked
from soma_runtime.loaders.onnx.ops.layout import joined, reshape_to
from soma_runtime.loaders.onnx.ops.table import onnx_op


@dataclass(frozen=True)
class Sequence:
    """A sequence of tensors while the graph converts: its items are the graph's Values or known arrays."""
    items: tuple = ()


def position(cv, seq: Sequence, index, inserting: bool = False) -> int:
    """A position in `seq` (negative: from the end), known at import; an insertion may also be at its end."""
    length = len(seq.items) + inserting
    if index is None:
        return length - 1
    p = cv.ints(index, "position")[0]
    if not -length <= p < length:
        raise cv.invalid(f"position {p} is outside a sequence of {len(seq.items)} tensors")
    return p % length


@onnx_op("SequenceEmpty")
def sequence_empty(cv, n):
    return Sequence()


@onnx_op("SequenceConstruct")
def sequence_construct(cv, n):
    return Sequence(tuple(n.inputs))


@onnx_op("SequenceLength", sequences=True)
def sequence_length(cv, n):
    return np.array(len(n.inputs[0].items), np.int64)


@onnx_op("SequenceAt", sequences=True)
def sequence_at(cv, n):
    seq = n.inputs[0]
    return seq.items[position(cv, seq, n.inputs[1])]


@onnx_op("SequenceInsert", sequences=True)
def sequence_insert(cv, n):
    seq, x = n.inputs[:2]
    at = position(cv, seq, n.input(2), inserting=True)
    return Sequence((*seq.items[:at], x, *seq.items[at:]))


@onnx_op("SequenceErase", sequences=True)
def sequence_erase(cv, n):
    seq = n.inputs[0]
    at = position(cv, seq, n.input(1))
    return Sequence((*seq.items[:at], *seq.items[at + 1:]))


@onnx_op("SplitToSequence")
def split_to_sequence(cv, n):
    """Pieces of `split` sizes (a scalar: pieces of that size, the last one shorter), or of one each with the
    axis dropped unless `keepdims`."""
    x, split = n.inputs[0], n.input(1)
    dims = list(cv.meta(x).shape)
    axis = cv.axis(n.attr("axis", 0), len(dims))
    if not isinstance(dims[axis], int):
        raise SymbolicError(f"a split of symbolic axis {dims[axis]}")
    if split is None:
        sizes = [1] * dims[axis]
    elif np.ndim(cv.known(split, "split")) == 0:
        chunk = cv.ints(split, "split")[0]
        if chunk <= 0:
            raise cv.invalid(f"a split of {chunk}")
        sizes = [min(chunk, dims[axis] - start) for start in range(0, dims[axis], chunk)]
    else:
        sizes = cv.ints(split, "split")
    if sum(sizes) != dims[axis] or any(s < 0 for s in sizes):
        raise cv.invalid(f"split sizes {sizes} do not add up to axis {axis} of {dims}")
    if not sizes:
        return Sequence()
    parts = cv.emit("split", x, sizes=tuple(sizes), axis=axis)
    parts = parts if isinstance(parts, tuple) else (parts,)
    if split is None and not n.attr("keepdims", 1):
        parts = tuple(reshape_to(cv, p, dims[:axis] + dims[axis + 1:]) for p in parts)
    return Sequence(parts)


@onnx_op("ConcatFromSequence", sequences=True)
def concat_from_sequence(cv, n):
    """The tensors joined along `axis`, or stacked along a new one (`new_axis`)."""
    seq = list(n.inputs[0].items)
    if not seq:
        raise cv.invalid("it concatenates an empty sequence")
    if n.attr("new_axis", 0):
        return stacked(cv, seq, n.attr("axis"))
    return joined(cv, seq, cv.axis(n.attr("axis"), cv.meta(seq[0]).ndim))

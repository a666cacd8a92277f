"""Detection ops: non-max suppression, greedy per batch and class, whose output length only its inputs'
values decide. Its formula is a loop of picks as long as the most boxes a class may keep; hashed, it is
that formula at one pick and symbolic sizes (the same op at any size or limit), and interpreted (the
reference backend), at the node's own sizes and limit.
"""
from __future__ import annotations

import numpy as np

from soma_runtime.ir.atoms import Ref
from soma_runtime.ir.graph import DYNAMIC, Sym, TensorMeta, same_dim
from soma_runtime.ir.ops.base import check, float_dtype, op
from soma_runtime.ir.ops.primitive import nonzero


def nms_rule(metas, attrs):
    boxes, scores = metas
    check(boxes.ndim == 3 and boxes.shape[2] == 4, f"boxes must be [batch, boxes, 4], got {list(boxes.shape)}")
    check(scores.ndim == 3, f"scores must be [batch, classes, boxes], got {list(scores.shape)}")
    check(same_dim(boxes.shape[0], scores.shape[0]) is not False and same_dim(boxes.shape[1], scores.shape[2]) is not False,
          f"boxes {list(boxes.shape)} and scores {list(scores.shape)} disagree on the batch or the boxes")
    float_dtype(boxes, "boxes")
    float_dtype(scores, "scores")
    check(attrs["most"] >= 0, f"the most boxes a class keeps must be >= 0, got {attrs['most']}")
    return [TensorMeta((DYNAMIC, 3), "i64")]


def most_selected(boxes, scores, most, **_) -> int:
    """The most rows a selection can have (each batch and class keeps at most `most`, and at most its boxes):
    the bound its output is held to before it runs."""
    B, C, N = np.shape(scores)
    return B * C * min(most, N)


def canonical(metas, attrs):
    """The op as its formula is hashed: symbolic sizes, one pick (the loop's length is not its formula) and a
    score threshold (a parameter, given or not)."""
    return [TensorMeta(tuple(Sym(f"d{i}_{j}") for j in range(m.ndim)), m.dtype) for i, m in enumerate(metas)], \
        {**attrs, "most": 1, "threshold": 0.0}


@op("non_max_suppression", ["boxes", "scores"], nms_rule,
    {"most": 0, "iou": 0.0, "threshold": None, "center": False}, {"center": (False, True)},
    ranks=(3, 3), count=most_selected, canonical=canonical)
def non_max_suppression(A, boxes, scores, most, iou, threshold, center):
    """Picks unrolled, each over every (batch, class) at once: the standing box of the highest score (argmax
    keeps the lower index among equals) is kept where one stands, and it and every box overlapping it by more
    than `iou` (a positive intersection of boxes of positive area) stop standing. A table of every pick's
    (batch, class, box) is read at the kept picks' flat positions (nonzero's), batch then class then pick."""
    B, C, N = scores.shape
    if not isinstance(N, int) and most > 1:
        raise ValueError("non_max_suppression's picks are unrolled at a known count of boxes")
    steps = min(most, N) if isinstance(N, int) else most
    lows, highs = corners(A, boxes, center, (B, C, N))
    area = A.mul(A.sub(highs[0], lows[0]), A.sub(highs[1], lows[1]))
    standing = A.read("fill", shape=(B, C, N), value=1) if threshold is None else \
        A.cmp("lt", A.param(float(threshold)), scores)
    position = A.read("iota", n=N, axis=2, ndim=3)
    table = A.read("fill", shape=(B, C, steps, 3), value=0)
    kept = A.read("fill", shape=(B, C, steps), value=0)
    for axis, size in ((0, B), (1, C)):
        index = A.read("broadcast", A.read("iota", n=size, axis=axis, ndim=4), shape=(B, C, steps, 1))
        table = A.write("place", table, index, axes=(3,), starts=(axis,), steps=(1,))
    for step in range(steps):
        best = A.reduce("argmax", A.cmp("select", standing, scores, A.lit(-np.inf)), axis=2, keepdims=True)
        table = A.write("place", table, A.read("expand", best, axis=3), axes=(2, 3), starts=(step, 2), steps=(1, 1))
        kept = A.write("place", kept, A.reduce("max", standing, axis=2, keepdims=True), axes=(2,), starts=(step,),
                       steps=(1,))
        picked = ([A.read("take_along", v, best, axis=2) for v in lows], [A.read("take_along", v, best, axis=2) for v in highs])
        dropped = A.cmp("max", overlaps(A, lows, highs, area, picked, iou), A.cmp("eq", position, best))
        standing = A.mul(standing, A.sub(A.lit(1), dropped))
    flat = A.read("reshape", kept, shape=(B * C * steps,))
    where = A.read("reshape", nonzero(A, Ref(flat.index, (B * C * steps,), "f32")), shape=(-1,))
    return A.read("cast", A.read("take", A.read("reshape", table, shape=(B * C * steps, 3)), where, axis=0), struct=("i64",))


def corners(A, boxes, center: bool, shape: tuple):
    """([low y, low x], [high y, high x]), each [B, C, N] (`shape`), of boxes [B, N, 4] given as two corners in
    either order, or (center) as x and y centre, width and height."""
    B, N = shape[0], shape[2]
    coordinate = [A.read("broadcast", A.read("reshape", A.read("slice", boxes, axis=2, start=k, stop=k + 1), shape=(B, 1, N)),
                         shape=shape) for k in range(4)]
    if center:
        x, y, width, height = coordinate
        half_h, half_w = A.mul(height, A.lit(0.5)), A.mul(width, A.lit(0.5))
        return [A.sub(y, half_h), A.sub(x, half_w)], [A.add(y, half_h), A.add(x, half_w)]
    y1, x1, y2, x2 = coordinate
    return [A.cmp("min", y1, y2), A.cmp("min", x1, x2)], [A.cmp("max", y1, y2), A.cmp("max", x1, x2)]


def overlaps(A, lows, highs, area, picked, iou: float):
    """Whether each box overlaps the picked one ([B, C, 1] corners) by more than `iou`: a positive intersection
    of boxes of positive area, as the ONNX reference counts it."""
    (low_y, low_x), (high_y, high_x) = lows, highs
    (p_low_y, p_low_x), (p_high_y, p_high_x) = picked
    height = A.sub(A.cmp("min", high_y, p_high_y), A.cmp("max", low_y, p_low_y))
    width = A.sub(A.cmp("min", high_x, p_high_x), A.cmp("max", low_x, p_low_x))
    inter = A.mul(height, width)
    picked_area = A.mul(A.sub(p_high_y, p_low_y), A.sub(p_high_x, p_low_x))
    union = A.sub(A.add(area, picked_area), inter)
    ok = A.cmp("lt", A.lit(0), height)
    for positive in (width, inter, area, picked_area, union):
        ok = A.mul(ok, A.cmp("lt", A.lit(0), positive))
    return A.mul(ok, A.cmp("lt", A.param(float(iou)), A.mul(inter, A.exp("recip", union))))

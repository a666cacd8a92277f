"""Detectors' ops: NonMaxSuppression, greedy per batch and class, unrolled over the most boxes a class
may keep; what it selects is a count only the data decides."""
from __future__ import annotations

import numpy as np

from soma_runtime.loaders.onnx.fold import SymbolicError
from soma_runtime.loaders.onnx.ops.layout import joined, reshape_to
from soma_runtime.loaders.onnx.ops.table import onnx_op


def corners(cv, boxes, centered: bool):
    """[B, 1, N] tensors of each box's low and high y and x (corners given in either order, or a centre
    and a size)."""
    coordinate = [reshape_to(cv, cv.emit("take", boxes, np.array(i, np.int64), axis=2), (*cv.meta(boxes).shape[:1], 1, -1))
                  for i in range(4)]
    if centered:                                         # x centre, y centre, width, height
        x, y, width, height = coordinate
        half_w, half_h = (cv.emit("mul", v, np.array(0.5, np.float32)) for v in (width, height))
        return cv.emit("sub", y, half_h), cv.emit("sub", x, half_w), cv.emit("add", y, half_h), cv.emit("add", x, half_w)
    y1, x1, y2, x2 = coordinate
    return (cv.emit("minimum", y1, y2), cv.emit("minimum", x1, x2), cv.emit("maximum", y1, y2),
            cv.emit("maximum", x1, x2))


def overlapping(cv, box, picked, area, threshold: float):
    """Which boxes overlap the picked one ([B, C, 1] corners) by more than the IoU threshold: a positive
    overlap of boxes of positive area, as the ONNX reference counts it."""
    low_y, low_x, high_y, high_x = box
    p_low_y, p_low_x, p_high_y, p_high_x = picked
    height = cv.emit("sub", cv.emit("minimum", high_y, p_high_y), cv.emit("maximum", low_y, p_low_y))
    width = cv.emit("sub", cv.emit("minimum", high_x, p_high_x), cv.emit("maximum", low_x, p_low_x))
    inter = cv.emit("mul", height, width)
    picked_area = cv.emit("mul", cv.emit("sub", p_high_y, p_low_y), cv.emit("sub", p_high_x, p_low_x))
    union = cv.emit("sub", cv.emit("add", area, picked_area), inter)
    zero = np.array(0, np.float32)
    ok = cv.emit("logical_and", cv.emit("greater", height, zero), cv.emit("greater", width, zero))
    for positive in (inter, area, picked_area, union):
        ok = cv.emit("logical_and", ok, cv.emit("greater", positive, zero))
    over = cv.emit("greater", cv.emit("div", inter, union), np.array(threshold, np.float32))
    return cv.emit("logical_and", ok, over)


@onnx_op("NonMaxSuppression")
def non_max_suppression(cv, n):
    """Per batch and class, the highest-scoring box still standing (the lower index among equals) is kept
    and every box overlapping it by more than the IoU threshold is dropped, up to the most a class keeps;
    the kept ones listed batch, class, then order kept: [count, 3]."""
    boxes, scores = n.inputs[0], n.inputs[1]
    batches, classes, count = cv.meta(scores).shape
    if not all(isinstance(d, int) for d in (batches, classes, count)):
        raise SymbolicError("NonMaxSuppression over symbolic sizes")
    most = max(int(cv.ints(n.input(2), "most boxes per class", [0])[0]), 0)
    iou = float(np.asarray(cv.known(n.input(3), "IoU threshold", np.zeros(1))).reshape(-1)[0])
    floor = cv.known(n.input(4), "score threshold")
    steps = min(most, count)
    if steps == 0:
        return np.zeros((0, 3), np.int64)
    box = corners(cv, cv.emit("cast", boxes, dtype="f32"), bool(n.attr("center_point_box", 0)))
    box = tuple(cv.emit("expand", v, shape=(batches, classes, count)) for v in box)
    area = cv.emit("mul", cv.emit("sub", box[2], box[0]), cv.emit("sub", box[3], box[1]))
    scores = cv.emit("cast", scores, dtype="f32")
    standing = cv.emit("greater", scores, np.array(np.asarray(floor).reshape(-1)[0], np.float32)) if floor is not None else \
        np.ones((batches, classes, count), np.bool_)
    positions = np.arange(count, dtype=np.int64)
    picks, kept = [], []
    for _ in range(steps):
        best = cv.emit("argmax", cv.emit("where", standing, scores, np.array(-np.inf, np.float32)), axis=2)
        pick = reshape_to(cv, best, (batches, classes, 1))
        picks.append(pick)
        kept.append(cv.emit("reduce_max", cv.emit("cast", standing, dtype="u8"), axes=(2,), keepdims=True))
        picked = tuple(cv.emit("gather", v, pick, axis=2) for v in box)
        dropped = cv.emit("logical_or", overlapping(cv, box, picked, area, iou), cv.emit("equal", positions, pick))
        standing = cv.emit("logical_and", standing, cv.emit("logical_not", dropped))
    picks, kept = joined(cv, picks, 2), joined(cv, kept, 2)                                # [B, C, steps]
    where = cv.emit("nonzero", cv.emit("cast", kept, dtype="bool"))                       # [3, selected]: b, c, step
    flat = cv.emit("reduce_sum", cv.emit("mul", where, np.array([[classes * steps], [steps], [1]], np.int64)), axes=(0,),
                   keepdims=False)
    chosen = cv.emit("take", reshape_to(cv, picks, (-1,)), flat, axis=0)
    batch_class = cv.emit("slice", where, axis=0, start=0, stop=2)
    return cv.emit("permute", cv.emit("concat", batch_class, reshape_to(cv, chosen, (1, -1)), axis=0), perm=(1, 0))

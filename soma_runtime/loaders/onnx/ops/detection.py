"""Detectors' ops: NonMaxSuppression, the IR's non_max_suppression (greedy per batch and class; what it
selects is a count only the data decides)."""
from __future__ import annotations

import numpy as np

from soma_runtime.loaders.onnx.ops.table import onnx_op


@onnx_op("NonMaxSuppression")
def non_max_suppression(cv, n):
    """[count, 3] (batch, class, box), batch then class then order kept; a limit past the boxes a class has
    (INT64_MAX, as torch exports write it) keeps them all."""
    most = max(int(cv.ints(n.input(2), "most boxes per class", [0])[0]), 0)
    iou = float(np.asarray(cv.known(n.input(3), "IoU threshold", np.zeros(1))).reshape(-1)[0])
    floor = cv.known(n.input(4), "score threshold")
    boxes, scores = (cv.emit("cast", x, dtype="f32") for x in n.inputs[:2])
    count = cv.meta(scores).shape[2]
    return cv.emit("non_max_suppression", boxes, scores, most=min(most, count) if isinstance(count, int) else most,
                   iou=iou, threshold=None if floor is None else float(np.asarray(floor).reshape(-1)[0]),
                   center=bool(n.attr("center_point_box", 0)))

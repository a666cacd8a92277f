"""CPU jet for non-max suppression: per batch and class, boxes in order of score (the lower index first among
equals), each kept unless it overlaps one kept before it by more than the IoU threshold, as the op defines."""
from __future__ import annotations

import numpy as np
from numba import njit

from soma_runtime.backends.cpu.common import CPU, F
from soma_runtime.ir.jets import jet


@jet("non_max_suppression", CPU, [(F, F)])
def non_max_suppression(boxes, scores, most, iou, threshold, center, out=None):
    boxes, scores = np.asarray(boxes, np.float32), np.ascontiguousarray(scores, np.float32)
    if center:                                   # x and y centre, width, height
        x, y, width, height = np.moveaxis(boxes, -1, 0)
        middle, half = np.stack([y, x], -1), np.stack([height, width], -1) / np.float32(2)
        lows, highs = middle - half, middle + half
    else:                                        # two corners (y, x), in either order
        lows, highs = np.minimum(boxes[..., 0:2], boxes[..., 2:4]), np.maximum(boxes[..., 0:2], boxes[..., 2:4])
    B, C, N = scores.shape
    rows = np.empty((B * C * min(most, N), 3), np.int64)
    count = _suppress(np.ascontiguousarray(lows), np.ascontiguousarray(highs), scores, most, np.float32(iou),
                      np.float32(0 if threshold is None else threshold), threshold is not None, rows)
    return rows[:count].copy()


@njit(cache=True, error_model="numpy")
def _suppress(lows, highs, scores, most, iou, threshold, thresholded, rows):
    """The selection into rows (batch, class, box), batch then class then order kept; returns its count."""
    B, C, N = scores.shape
    area = (highs[:, :, 0] - lows[:, :, 0]) * (highs[:, :, 1] - lows[:, :, 1])
    kept = np.empty(N, np.int64)
    count = 0
    for b in range(B):
        for c in range(C):
            row = scores[b, c]
            order = np.argsort(-row, kind="mergesort")
            n = 0
            for i in order:
                if n == most:
                    break
                if thresholded and not row[i] > threshold:
                    continue
                standing = True
                for s in range(n):
                    j = kept[s]
                    height = min(highs[b, i, 0], highs[b, j, 0]) - max(lows[b, i, 0], lows[b, j, 0])
                    width = min(highs[b, i, 1], highs[b, j, 1]) - max(lows[b, i, 1], lows[b, j, 1])
                    if height > 0 and width > 0:
                        inter = height * width
                        union = area[b, i] + area[b, j] - inter
                        if inter > 0 and area[b, i] > 0 and area[b, j] > 0 and union > 0 and inter / union > iou:
                            standing = False
                            break
                if standing:
                    kept[n] = i
                    n += 1
                    rows[count, 0], rows[count, 1], rows[count, 2] = b, c, i
                    count += 1
    return count

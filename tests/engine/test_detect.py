"""engine/detect.py on boxes written by hand: candidates as ultralytics keeps them (the best class over conf, the
classes filter, corners from centre and size), NMS class-aware (a box of another class is never suppressed) and
greedy by score at the IoU given, max_det the best kept, several images in one run of the IR's
non_max_suppression op, the same on the reference backend (the op's atoms) as on the CPU's jet; rows already
suppressed only thresholded, filtered and cut."""
from __future__ import annotations

import numpy as np
import pytest

from soma_runtime.backends import get
from soma_runtime.engine.detect import Suppressor, Thresholds, candidates, decode, suppressed


def head(rows: list[tuple]) -> np.ndarray:
    """[4 + 3, N] head rows of (cx, cy, w, h, class, score): the score on that class, 0.01 on the others."""
    out = np.full((7, len(rows)), 0.01, np.float32)
    for i, (cx, cy, w, h, c, score) in enumerate(rows):
        out[:4, i] = (cx, cy, w, h)
        out[4 + c, i] = score
    return out


# boxes 0, 1 of class 0 overlap (IoU 0.82); box 2, of class 1, lies on box 0; box 3 (class 0) stands apart; box 4 is
# below conf
ROWS = [(50, 50, 20, 20, 0, 0.9), (51, 51, 20, 20, 0, 0.8), (50, 50, 20, 20, 1, 0.7), (150, 150, 10, 10, 0, 0.6),
        (100, 100, 10, 10, 2, 0.2)]


@pytest.fixture(params=["cpu", "reference"])
def suppress(request) -> Suppressor:
    return Suppressor(get(request.param))


def test_candidates_are_the_best_class_over_conf_as_corners():
    found = candidates(head(ROWS), Thresholds(conf=0.25))
    assert found.classes.tolist() == [0, 0, 1, 0]
    np.testing.assert_allclose(found.scores, [0.9, 0.8, 0.7, 0.6])
    np.testing.assert_array_equal(found.boxes[0], [40, 40, 60, 60])
    assert candidates(head(ROWS), Thresholds(conf=0.25, classes=(1, 2))).classes.tolist() == [1]


def test_nms_is_class_aware_and_greedy_by_score(suppress):
    (kept,) = decode(head(ROWS)[None], Thresholds(conf=0.25, iou=0.45), suppress)
    assert kept.classes.tolist() == [0, 1, 0]                   # box 1 suppressed by box 0; box 2 of another class kept
    np.testing.assert_allclose(kept.scores, [0.9, 0.7, 0.6])
    (loose,) = decode(head(ROWS)[None], Thresholds(conf=0.25, iou=0.9), suppress)
    assert len(loose.scores) == 4                               # IoU 0.82 is not over 0.9
    (best,) = decode(head(ROWS)[None], Thresholds(conf=0.25, iou=0.45, max_det=2), suppress)
    np.testing.assert_allclose(best.scores, [0.9, 0.7])


def test_several_images_of_several_counts_are_one_run(suppress):
    images = np.stack([head(ROWS), head(ROWS[::-1]), head([(0, 0, 4, 4, 0, 0.1)] * 5)])
    found = decode(images, Thresholds(conf=0.25, iou=0.45), suppress)
    assert [f.classes.tolist() for f in found] == [[0, 1, 0], [0, 1, 0], []]
    assert len(suppress.runners) == 1


def test_rows_suppressed_in_the_graph_are_only_thresholded_filtered_and_cut():
    rows = np.zeros((1, 300, 6), np.float32)
    rows[0, :4] = [[0, 0, 9, 9, 0.9, 3], [1, 1, 9, 9, 0.5, 1], [2, 2, 9, 9, 0.4, 3], [3, 3, 9, 9, 0.2, 3]]
    (kept,) = suppressed(rows, Thresholds(conf=0.25))
    assert kept.classes.tolist() == [3, 1, 3] and kept.boxes.shape == (3, 4)
    (kept,) = suppressed(rows, Thresholds(conf=0.25, max_det=2, classes=(3,)))
    assert kept.classes.tolist() == [3, 3] and kept.scores.tolist() == pytest.approx([0.9, 0.4])

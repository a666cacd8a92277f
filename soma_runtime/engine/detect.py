"""Boxes and their suppression for object detectors, as ultralytics' `ops.non_max_suppression` does it for the
detect task: a YOLOv8/YOLO11 head's [B, 4 + C, N] rows (box centre, width and height, then C class scores)
become candidates (the best class's score over `conf`, the `classes` kept, at most MAX_NMS by score), their
corners offset by class (ultralytics' max_wh trick: boxes of two classes never overlap) and suppressed by the
IR's `non_max_suppression` op, run as a small graph through a Program on the model's backend (no second NMS
here), at most `max_det` kept, by score. Rows already suppressed ([B, K, 6]: x1, y1, x2, y2, score, class, an
export with NMS in its graph or an end-to-end head) are only thresholded, filtered by class and cut to `max_det`.
Knows nothing of files, images' decoding or servers; boxes are in the pixels of the image the model saw.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from soma_runtime.engine.graph import GraphRunner, graph_runner
from soma_runtime.ir.backend import Backend
from soma_runtime.ir.builder import GraphBuilder

MAX_WH = 7680                     # ultralytics' class offset in pixels: past any box, so classes never overlap
MAX_NMS = 30000                   # the most candidates suppressed, the best by score (ultralytics' max_nms)
SMALLEST_BUCKET = 64              # candidates are padded to a power of two from this, so few plans are made
PROGRAMS_KEPT = 8                 # NMS graphs (one per IoU and max_det) kept


@dataclass(frozen=True)
class Detection:
    """One object found: `box` (x1, y1, x2, y2) in the original image's pixels, its class id and label, and the
    confidence (the class's score)."""
    box: tuple[float, float, float, float]
    class_id: int
    label: str
    confidence: float

    def to_dict(self) -> dict:
        return {"box": list(self.box), "class_id": self.class_id, "label": self.label, "confidence": self.confidence}


@dataclass(frozen=True)
class Thresholds:
    """What is kept: a score over `conf`, boxes overlapping a better one of their class by at most `iou`, the
    `max_det` best, of the `classes` given (all when None)."""
    conf: float = 0.25
    iou: float = 0.45
    max_det: int = 300
    classes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Found:
    """One image's detections as arrays, best first: boxes [n, 4] (x1, y1, x2, y2), scores [n], class ids [n]."""
    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray


def xywh_to_xyxy(boxes: np.ndarray) -> np.ndarray:
    """[n, 4] centre, width, height -> corners, in float32 as ultralytics' xywh2xyxy computes them."""
    middle, half = boxes[:, :2], boxes[:, 2:] / np.float32(2)
    return np.concatenate([middle - half, middle + half], axis=1)


def candidates(rows: np.ndarray, limits: Thresholds) -> Found:
    """One image's [4 + C, N] head rows as ultralytics keeps them for NMS: the best class over `conf` (its first
    among equal scores), the `classes` filter, at most MAX_NMS by score; in the head's anchor order."""
    scores = rows[4:]
    keep = np.flatnonzero(scores.max(axis=0) > limits.conf)
    best = scores[:, keep].argmax(axis=0)
    found = Found(xywh_to_xyxy(np.ascontiguousarray(rows[:4, keep].T)), scores[best, keep], best)
    if limits.classes is not None:
        wanted = np.isin(found.classes, limits.classes)
        found = Found(found.boxes[wanted], found.scores[wanted], found.classes[wanted])
    if len(found.scores) > MAX_NMS:
        top = np.argsort(-found.scores, kind="stable")[:MAX_NMS]
        found = Found(found.boxes[top], found.scores[top], found.classes[top])
    return found


def bucket(count: int) -> int:
    """The padded count of candidates: the next power of two from SMALLEST_BUCKET."""
    return max(SMALLEST_BUCKET, 1 << max(count - 1, 0).bit_length())


class Suppressor:
    """Class-aware NMS of several images' candidates at once, through the IR's non_max_suppression op on one
    backend: a graph per (IoU, max_det), its Program planned once per padded count of candidates."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.runners: OrderedDict[tuple[float, int], GraphRunner] = OrderedDict()

    def runner(self, iou: float, most: int) -> GraphRunner:
        key = (iou, most)
        if key not in self.runners:
            g = GraphBuilder()
            boxes, scores = g.input("boxes", ("B", "N", 4), "f32"), g.input("scores", ("B", 1, "N"), "f32")
            # scores are over conf >= 0: a threshold of 0 drops only the padding (scored 0)
            kept = g.non_max_suppression(boxes, scores, most=most, iou=iou, threshold=0.0, center=False)
            self.runners[key] = graph_runner(g.output(kept), self.backend)
            while len(self.runners) > PROGRAMS_KEPT:
                self.runners.popitem(last=False)
        self.runners.move_to_end(key)
        return self.runners[key]

    def __call__(self, found: list[Found], limits: Thresholds) -> list[Found]:
        """Each image's candidates suppressed: what survives, best first, at most max_det."""
        if not any(len(f.scores) for f in found):
            return found
        width = bucket(max(len(f.scores) for f in found))
        boxes = np.zeros((len(found), width, 4), np.float32)
        scores = np.zeros((len(found), 1, width), np.float32)
        for i, f in enumerate(found):
            n = len(f.scores)
            # corners offset by class, in float32 as ultralytics adds them; IoU is symmetric in x and y, so the
            # op's (y1, x1, y2, x2) order takes (x1, y1, x2, y2) as they are
            boxes[i, :n] = f.boxes + (f.classes.astype(np.float32) * np.float32(MAX_WH))[:, None]
            scores[i, 0, :n] = f.scores
        selected = self.runner(float(limits.iou), limits.max_det).run({"boxes": boxes, "scores": scores})
        rows = next(iter(selected.values()))
        kept = []
        for i, f in enumerate(found):
            index = rows[rows[:, 0] == i, 2]              # in the order kept: by score, best first
            kept.append(Found(f.boxes[index], f.scores[index], f.classes[index]))
        return kept


def decode(head: np.ndarray, limits: Thresholds, suppress: Suppressor) -> list[Found]:
    """A plain head's [B, 4 + C, N] output: each image's detections after NMS, best first."""
    return suppress([candidates(rows, limits) for rows in np.asarray(head, np.float32)], limits)


def suppressed(rows: np.ndarray, limits: Thresholds) -> list[Found]:
    """An output already suppressed ([B, K, 6]: x1, y1, x2, y2, score, class; zero rows pad it): each image's rows
    over `conf`, of the `classes` given, the first max_det (the graph gives them best first)."""
    found = []
    for image in np.asarray(rows, np.float32):
        keep = image[:, 4] > limits.conf
        if limits.classes is not None:
            keep &= np.isin(image[:, 5], limits.classes)
        image = image[keep][:limits.max_det]
        found.append(Found(image[:, :4], image[:, 4], image[:, 5].astype(np.int64)))
    return found

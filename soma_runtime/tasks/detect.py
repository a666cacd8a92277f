"""The detect task: DetectModel, an object detector (an ultralytics YOLOv8/YOLO11 detect export): images in,
each one's detections out (engine/detect.Detection: a box in the original image's pixels, class id, label,
confidence), as ultralytics' predict finds them."""
from __future__ import annotations

import reprlib

import numpy as np

from soma_runtime import loaders
from soma_runtime.engine.detect import Detection, Found, Suppressor, Thresholds, decode, suppressed
from soma_runtime.engine.graph import FamilyRunner, GraphRunner
from soma_runtime.errors import RequestError
from soma_runtime.image.io import Image, load_image
from soma_runtime.image.preprocess import Letterbox, boxes_to_original, letterbox, letterbox_batch
from soma_runtime.ir.backend import Backend
from soma_runtime.tasks.graph import GraphModel

MAX_IMAGES = 64                   # images one call (one request) may detect in
MAX_BATCH = 16                    # images one run of the graph takes, where its batch is free
MAX_DET = 30000                   # the most detections an image may keep (ultralytics' max_nms)


def check_thresholds(conf, iou, max_det, classes, labels: dict[int, str]) -> Thresholds:
    """The thresholds of a detect call, checked: conf and iou numbers in [0, 1], max_det an integer in
    [1, MAX_DET], classes None or a list of the model's class ids."""
    for name, value in (("conf", conf), ("iou", iou)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise RequestError(f"{name} must be a number in [0, 1], got {reprlib.repr(value)}")
    if type(max_det) is not int or not 1 <= max_det <= MAX_DET:
        raise RequestError(f"max_det must be an integer in [1, {MAX_DET}], got {reprlib.repr(max_det)}")
    if classes is not None:
        if not isinstance(classes, (list, tuple)) or not classes or \
                not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) and int(c) in labels for c in classes):
            raise RequestError(f"classes must be a non-empty list of class ids in [0, {len(labels) - 1}], "
                               f"got {reprlib.repr(classes)}")
        classes = tuple(sorted({int(c) for c in classes}))
    return Thresholds(float(conf), float(iou), max_det, classes)


class DetectModel(GraphModel):
    """An object detector: `detect(images)` gives each image's detections, best first. Its graph stays runnable
    as a graph's (`run`: the head's raw output)."""

    task = "detect"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, runner: GraphRunner | FamilyRunner):
        super().__init__(model_id, loaded, backend, runner)
        self.spec = loaded.detector
        self.suppress = Suppressor(backend)

    @property
    def labels(self) -> dict[int, str]:
        return self.spec.labels

    @property
    def input_size(self) -> tuple[int, int] | None:
        """(height, width) of a graph whose input size is fixed; None where it takes any."""
        shape = self.runner.inputs[self.spec.input].shape
        return (shape[2], shape[3]) if all(isinstance(d, int) for d in shape[2:]) else None

    @property
    def batch_size(self) -> int:
        """Images one run takes: a fixed batch's; an export with NMS in its graph, the batch it was exported for
        (its per-image loop is unrolled to it); else up to MAX_BATCH."""
        first = self.runner.inputs[self.spec.input].shape[0]
        if isinstance(first, int):
            return first
        return self.spec.batch if self.spec.suppressed else MAX_BATCH

    def letterboxes(self, images: list[Image]) -> list[Letterbox]:
        """The images letterboxed as ultralytics' predict does for this model: to a fixed input's size; for a
        graph of any size, to the exported imgsz, padded only to a multiple of the stride where every image of
        the call has one shape (predict's rect letterbox), to the square otherwise."""
        fixed = self.input_size
        rect = fixed is None and len({im.size for im in images}) == 1
        return [letterbox(im.pixels, fixed or self.spec.size, auto=rect, stride=self.spec.stride) for im in images]

    def detect(self, images, conf: float = 0.25, iou: float = 0.45, max_det: int = 300,
               classes: list[int] | None = None) -> list[Detection] | list[list[Detection]]:
        """The objects in `images` (one image, or a list of them: each anything image.io.load_image takes: a path,
        the file's bytes, a numpy array, a PIL image, a data: URL) as ultralytics' predict finds them: letterboxed
        (letterboxes), run as one batch, candidates over `conf`, class-aware NMS at `iou`, at most `max_det` an
        image, of the `classes` given (all when None). One image gives its list of detections, best first; a list
        of images a list of such lists."""
        limits = check_thresholds(conf, iou, max_det, classes, self.labels)
        many = isinstance(images, (list, tuple))
        if many and not 1 <= len(images) <= MAX_IMAGES:
            raise RequestError(f"detect in one image or a list of 1 to {MAX_IMAGES}, got {len(images)}")
        decoded = [load_image(im, name=f"images[{i}]") for i, im in enumerate(images)] if many else [load_image(images)]
        boxes = self.letterboxes(decoded)
        found: list[Found] = []
        step, fixed = self.batch_size, isinstance(self.runner.inputs[self.spec.input].shape[0], int)
        for start in range(0, len(boxes), step):
            chunk = boxes[start:start + step]
            batch = letterbox_batch(chunk)
            if fixed and len(chunk) < step:            # a fixed batch, filled with copies of the last image
                batch = np.concatenate([batch, np.repeat(batch[-1:], step - len(chunk), axis=0)])
            out = self.runner.run({self.spec.input: batch})[self.spec.output][:len(chunk)]
            found += suppressed(out, limits) if self.spec.suppressed else decode(out, limits, self.suppress)
        detections = [self.detections(f, box) for f, box in zip(found, boxes)]
        return detections if many else detections[0]

    def detections(self, found: Found, box: Letterbox) -> list[Detection]:
        corners = boxes_to_original(found.boxes, box)
        return [Detection(tuple(float(v) for v in corner), int(c), self.labels.get(int(c), str(int(c))), float(s))
                for corner, c, s in zip(corners, found.classes, found.scores)]

    def info(self) -> dict:
        size = self.input_size
        return {**super().info(), "head": self.spec.head, "classes": len(self.labels), "nms_in_graph": self.spec.suppressed,
                "input_size": list(size or self.spec.size), "dynamic_size": size is None}


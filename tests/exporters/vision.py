"""Exports by the tools people use for vision models, made in the exporters' own environment (torchvision and
ultralytics need the CUDA build of torch; `make setup` builds it as .venv-exporters): torchvision's classifiers
and a detector through both torch exporters (TorchScript and dynamo) with dynamic batch and image axes, and
ultralytics' YOLOv8n and YOLO11n built from their yaml (random weights) exported with dynamic axes, with and
without NMS. Each file is written once under the directory given; a manifest (manifest.json) names each file,
its input, the input sizes to check it at, and the exporter's versions. Where OUT_DIR/photos holds PNG images
(the tests write scikit-image's photos there first), the manifest also holds ultralytics' own `predict` of both
YOLOs on them (the same weights as the exports): each photo alone, and all of them as one batch.

Run: .venv-exporters/bin/python tests/exporters/vision.py OUT_DIR [NAME ...]
Imports nothing of soma_runtime: the tests compare its runs of these files with onnxruntime's."""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torchvision

CLASSIFIERS = {            # name -> the image sizes (height, width) a test runs it at (vit_b_16 takes 224 only)
    "resnet18": [(64, 64), (96, 128)],
    "mobilenet_v3_small": [(64, 64), (96, 128)],
    "efficientnet_b0": [(64, 64), (96, 128)],
    "convnext_tiny": [(64, 64), (96, 128)],
    "vit_b_16": [(224, 224)],
}
DETECTOR = "ssdlite320_mobilenet_v3_large"
YOLOS = ("yolov8n", "yolo11n")
YOLO_SIZE = 640                   # the exports' imgsz (their metadata's) and predict's
PREDICT = {"conf": 0.25, "iou": 0.45, "imgsz": YOLO_SIZE, "max_det": 300}   # ultralytics' predict settings compared
NMS_CONF = 0.01                   # the score floor an NMS export bakes in: below any conf a test asks for
STATIC_BATCH = 2                  # the batch of the export with fixed sizes


def random_weights(module: torch.nn.Module) -> torch.nn.Module:
    """Weights drawn so activations neither vanish nor blow up through the depth (He's init on convolutions,
    norm scales near one) and no output is zero whatever the input (a head torchvision starts at zero is drawn
    too), the model in eval mode."""
    torch.manual_seed(0)
    for m in module.modules():
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight)
        elif isinstance(m, torch.nn.Linear) and not m.weight.any():        # vit's head starts at zero
            torch.nn.init.normal_(m.weight, std=0.05)
        elif isinstance(m, (torch.nn.BatchNorm2d, torch.nn.LayerNorm)) and m.weight is not None:
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return module.eval()


def export(module, example, path: Path, exporter: str, dynamic_image: bool, outputs: list[str]) -> None:
    """One export of `module` at `example` with a dynamic batch (and image size) through `exporter` (dynamo traces
    at a batch of 2: a size of 1 would be specialized)."""
    axes = {0: "batch", 2: "height", 3: "width"} if dynamic_image else {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(module, (example,), str(path), input_names=["x"], output_names=outputs,
                              dynamic_axes={"x": axes}, opset_version=17, dynamo=False)
        else:
            example = example.expand(2, *example.shape[1:])
            shapes = {axis: torch.export.Dim.DYNAMIC for axis in axes}
            torch.onnx.export(module, (example,), str(path), input_names=["x"], output_names=outputs,
                              dynamic_shapes={"x": shapes}, opset_version=18, dynamo=True, verbose=False)


def classifiers(out: Path, wanted) -> list[dict]:
    entries = []
    for name, sizes in CLASSIFIERS.items():
        if wanted and name not in wanted:
            continue
        module = random_weights(getattr(torchvision.models, name)())
        h, w = sizes[0]
        for exporter in ("torchscript", "dynamo"):
            path = out / f"{name}-{exporter}.onnx"
            if not path.exists():
                export(module, torch.randn(1, 3, h, w), path, exporter, name != "vit_b_16", ["logits"])
            entries.append({"file": path.name, "model": name, "exporter": exporter, "input": "x",
                            "shapes": [[1, 3, *sizes[0]], [2, 3, *sizes[-1]]]})
    return entries


class Boxes(torch.nn.Module):
    """A torchvision detector's boxes, scores and labels for one image (its forward takes a list)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        found = self.model([x[0]])[0]
        return found["boxes"], found["scores"], found["labels"]


def detector(out: Path) -> list[dict]:
    """torchvision's SSDlite (MobileNetV3 backbone; its own resize to 320, score threshold and batched NMS in the
    graph) through TorchScript; the dynamo exporter's output of it is listed when the exporter manages it."""
    module = Boxes(random_weights(getattr(torchvision.models.detection, DETECTOR)(weights=None, weights_backbone=None)))
    entries = []
    path = out / f"{DETECTOR}-torchscript.onnx"
    if not path.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (torch.rand(1, 3, 240, 320),), str(path), input_names=["x"],
                              output_names=["boxes", "scores", "labels"], dynamic_axes={"x": {2: "height", 3: "width"}},
                              opset_version=17, dynamo=False)
    entries.append({"file": path.name, "model": DETECTOR, "exporter": "torchscript", "input": "x", "positive": True,
                    "shapes": [[1, 3, 240, 320], [1, 3, 300, 200]]})
    return entries


def yolo(name: str):
    """ultralytics' `name` from its yaml with random weights that carry an image through: He's init (the DFL's fixed
    bins kept), and class scores whose logits vary with the features, their biases drawn low, so that a few tens of
    boxes pass a confidence of 0.25 on a photo, their scores apart (ultralytics' own init leaves features ~1e-7:
    every anchor then scores its class's prior, all tied)."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    from ultralytics import YOLO
    torch.manual_seed(0)
    model = YOLO(f"{name}.yaml")
    head = model.model.model[-1]
    bins = head.dfl.conv.weight.data.clone()
    random_weights(model.model)
    head.dfl.conv.weight.data.copy_(bins)
    for branch in head.cv3:
        branch[-1].weight.data.normal_(0, 0.3)
        branch[-1].bias.data.normal_(-4, 1)
    return model


def yolos(out: Path) -> list[dict]:
    """ultralytics' YOLOv8n and YOLO11n (yolo()), exported by ultralytics itself with dynamic axes at imgsz 640, plain
    ([B, 84, N] rows of box and class scores) and with NMS in the graph ([B, 300, 6]: box, score, class, padded with
    zeros; predict's IoU, and a score floor of NMS_CONF); and YOLO11n with fixed sizes (a batch of STATIC_BATCH)."""
    entries = []
    for name in YOLOS:
        for nms in (False, True):
            path = out / f"{name}{'-nms' if nms else ''}.onnx"
            if not path.exists():
                thresholds = {"conf": NMS_CONF, "iou": PREDICT["iou"]} if nms else {}
                made = yolo(name).export(format="onnx", dynamic=True, nms=nms, imgsz=YOLO_SIZE, simplify=False, opset=17,
                                         verbose=False, **thresholds)
                os.replace(made, path)
            entries.append({"file": path.name, "model": name, "exporter": "ultralytics", "input": "images", "nms": nms,
                            "positive": True, "shapes": [[1, 3, 320, 320], [2, 3, 256, 320]]})
    path = out / f"{YOLOS[-1]}-static.onnx"          # fixed sizes: a batch of STATIC_BATCH at 640 x 640
    if not path.exists():
        os.replace(yolo(YOLOS[-1]).export(format="onnx", dynamic=False, batch=STATIC_BATCH, imgsz=YOLO_SIZE,
                                          simplify=False, opset=17, verbose=False), path)
    entries.append({"file": path.name, "model": YOLOS[-1], "exporter": "ultralytics", "input": "images", "nms": False,
                    "positive": True, "shapes": [[STATIC_BATCH, 3, YOLO_SIZE, YOLO_SIZE]]})
    return entries


def predictions(photos: list[Path]) -> dict:
    """ultralytics' predict (PREDICT) of each YOLO on the photos: each alone ("single": a rectangle letterbox, as
    predict makes for one image) and all at once ("batch": one batch, so a square letterbox), as rows of
    x1, y1, x2, y2, confidence, class in the photos' pixels."""
    found = {}
    for name in YOLOS:
        model = yolo(name)
        single = [model.predict(str(p), verbose=False, **PREDICT)[0] for p in photos]
        batch = model.predict([str(p) for p in photos], batch=len(photos), verbose=False, **PREDICT)
        found[name] = {mode: [r.boxes.data.tolist() for r in results] for mode, results in
                       (("single", single), ("batch", batch))}
    return {"settings": PREDICT, "photos": [p.name for p in photos], "models": found}


def main():
    out = Path(sys.argv[1])
    wanted = set(sys.argv[2:])
    out.mkdir(parents=True, exist_ok=True)
    entries = classifiers(out, wanted)
    if not wanted or DETECTOR in wanted:
        entries += detector(out)
    if not wanted or wanted & set(YOLOS):
        entries += yolos(out)
    import ultralytics
    manifest = {"torch": torch.__version__, "torchvision": torchvision.__version__,
                "ultralytics": ultralytics.__version__, "models": entries}
    photos = sorted((out / "photos").glob("*.png"))
    if photos and (not wanted or wanted & set(YOLOS)):
        manifest["predictions"] = predictions(photos)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()

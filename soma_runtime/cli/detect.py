"""`soma-runtime detect`: the objects in images, found by a detect model (an ultralytics YOLOv8/YOLO11 export),
printed as text (a line per detection) or JSON (a line per image), and with --out drawn on the images. With one
image --out names the annotated file to write; with several it names a directory (made if missing) where each
image is written under its own file name."""
from __future__ import annotations

import json
import os

import PIL.Image
import PIL.ImageDraw

from soma_runtime.errors import RequestError

PALETTE = ((255, 56, 56), (255, 157, 151), (255, 112, 31), (255, 178, 29), (207, 210, 49), (72, 249, 10),
           (146, 204, 23), (61, 219, 134), (26, 147, 52), (0, 212, 187), (44, 153, 168), (0, 194, 255),
           (52, 69, 147), (100, 115, 255), (0, 24, 236), (132, 56, 255), (82, 0, 133), (203, 56, 255),
           (255, 149, 200), (255, 55, 199))          # ultralytics' colors, a class's by its id


def draw(image, detections, path: str) -> None:
    """The image with each detection's box and "label confidence" drawn on it, written to `path` (its format by
    its extension, as Pillow reads it)."""
    canvas = PIL.Image.fromarray(image.pixels)
    pen = PIL.ImageDraw.Draw(canvas)
    width = max(1, round(sum(canvas.size) / 2 * 0.003))
    for d in detections:
        color = PALETTE[d.class_id % len(PALETTE)]
        pen.rectangle(d.box, outline=color, width=width)
        text = f"{d.label} {d.confidence:.2f}"
        left, top, right, bottom = pen.textbbox((d.box[0], d.box[1]), text)
        lift = bottom - top + 2 if d.box[1] >= bottom - top + 2 else 0     # above the box where there is room
        pen.rectangle((left, top - lift, right + 2, bottom - lift), fill=color)
        pen.text((d.box[0] + 1, d.box[1] - lift), text, fill=(255, 255, 255))
    try:
        canvas.save(path)
    except (ValueError, OSError) as e:
        raise RequestError(f"--out {path}: cannot write the annotated image ({e})") from None


def out_paths(out: str | None, images: list[str]) -> list[str] | None:
    """Where each annotated image goes: --out itself for one image; for several, --out is a directory (made if
    missing) and each keeps its own file name (two of one name are refused)."""
    if out is None:
        return None
    if len(images) == 1 and not os.path.isdir(out):
        return [out]
    if os.path.exists(out) and not os.path.isdir(out):
        raise RequestError(f"--out {out}: with several images --out names a directory (each image is written there "
                           f"under its own name), and {out} is a file")
    names = [os.path.basename(path) for path in images]
    if len(set(names)) < len(names):
        raise RequestError("--out: two images of one file name would overwrite each other's annotated copy")
    os.makedirs(out, exist_ok=True)
    return [os.path.join(out, name) for name in names]


def cmd_detect(args) -> int:
    from soma_runtime.image.io import load_image
    from soma_runtime.tasks import Runtime
    targets = out_paths(args.out, args.image)
    model = Runtime(args.backend, threads=args.threads).load(args.model, sha256=args.sha256, progress=False)
    if model.task != "detect":
        raise RequestError(f"{args.model} is a {model.task} model; detect needs an object detector (an ultralytics "
                           f"YOLOv8/YOLO11 detect export, .onnx)")
    images = [load_image(path) for path in args.image]
    found = model.detect(images, conf=args.conf, iou=args.iou, max_det=args.max_det, classes=args.classes)
    for path, detections in zip(args.image, found):
        if args.json:
            print(json.dumps({"image": path, "detections": [d.to_dict() for d in detections]}))
            continue
        print(f"{path}: {len(detections)} detection{'s' if len(detections) != 1 else ''}")
        for d in detections:
            print(f"  {d.label} {d.confidence:.3f} [{', '.join(f'{v:.1f}' for v in d.box)}]")
    for image, detections, target in zip(images, found, targets or ()):
        draw(image, detections, target)
    return 0


def add_parser(sub, sha256_arg) -> None:
    p = sub.add_parser("detect", help="find objects in images with a detector (an ultralytics YOLOv8/YOLO11 .onnx)")
    p.add_argument("--model", "-m", required=True, help="the detector's .onnx file (an ultralytics detect export)")
    p.add_argument("--image", "-i", required=True, nargs="+", help="images: JPEG, PNG, WebP, BMP or GIF")
    p.add_argument("--conf", type=float, default=0.25, help="the least confidence kept (default: 0.25)")
    p.add_argument("--iou", type=float, default=0.45, help="NMS: the most overlap with a better box of its class "
                   "(default: 0.45)")
    p.add_argument("--max-det", type=int, default=300, help="the most detections an image keeps (default: 300)")
    p.add_argument("--classes", type=int, nargs="+", default=None, help="keep only these class ids")
    p.add_argument("--out", "-o", default=None, help="draw the boxes: the annotated file for one image, a directory for "
                   "several (each written there under its own name)")
    p.add_argument("--json", action="store_true", help="one JSON object per image: its path and detections")
    p.add_argument("--sha256", type=sha256_arg, default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the physical cores)")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda", "reference"))
    p.set_defaults(run=cmd_detect)

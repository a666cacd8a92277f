"""`soma-runtime classify --image`: the most likely labels of images by an image classifier (a ViT or DeiT
directory), printed as text (the image, then a line per label) or JSON (a line per image). `classify` with texts
stays the encoders' (cli/main.py)."""
from __future__ import annotations

import json

from soma_runtime.errors import RequestError


def cmd_classify_images(args, model) -> int:
    if model.task != "encode_image":
        raise RequestError(f"{args.model or 'the default model'} runs the {model.task} task; classify --image needs an "
                           f"image classifier (a ViT or DeiT directory with its preprocessor_config.json)")
    if args.text or args.label:
        raise RequestError("classify takes --image or --text, not both (--label is for texts)")
    from soma_runtime.image.io import load_image
    found = model.classify_image([load_image(path) for path in args.image], top_k=args.top_k)
    for path, labels in zip(args.image, found):
        if args.json:
            print(json.dumps({"image": path, "labels": [{"label": label, "score": score} for label, score in labels]}))
            continue
        print(path)
        for label, score in labels:
            print(f"  {label} {score:.4f}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--image", "-i", nargs="+", default=None,
                   help="images to classify with an image model (JPEG, PNG, WebP, BMP or GIF), instead of texts")
    p.add_argument("--top-k", type=int, default=5, help="images: the most likely labels printed (default: 5)")
    p.add_argument("--json", action="store_true", help="images: one JSON object per image, its path and labels")

"""ultralytics' own letterbox and box mapping, the reference tests/image/test_preprocess.py holds ours to, run in
the exporters' environment (ultralytics needs OpenCV and the CUDA build of torch; `make setup` builds
.venv-exporters). For each case NAME listed in DIR/cases.json ({name: LetterBox's keyword arguments}) it reads
DIR/NAME.npy (an [H, W, 3] uint8 image) and DIR/NAME.boxes.npy ([N, 4] xyxy boxes in the letterboxed image's
pixels) and writes DIR/NAME.letterbox.npy (LetterBox's output), DIR/NAME.mapped.npy (ops.scale_boxes of the boxes
back to the image, given LetterBox's ratio and padding where it may not scale up) and, for all cases,
DIR/params.json (LetterBox.get_params: ratio, new_unpad, the four pads).

Run: .venv-exporters/bin/python tests/image/letterbox_reference.py DIR
Imports nothing of soma_runtime."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("YOLO_OFFLINE", "1")
from ultralytics.data.augment import LetterBox
from ultralytics.utils.ops import scale_boxes


def main(out: Path) -> None:
    params = {}
    for name, kwargs in json.loads((out / "cases.json").read_text()).items():
        image = np.load(out / f"{name}.npy")
        transform = LetterBox(**kwargs)
        got = transform.get_params({"img": image})
        params[name] = {"ratio": list(got["ratio"]), "new_unpad": list(got["new_unpad"]),
                        "pad": [got["top"], got["bottom"], got["left"], got["right"]]}
        boxed = transform(image=image)
        np.save(out / f"{name}.letterbox.npy", boxed)
        boxes = np.load(out / f"{name}.boxes.npy")
        # scale_boxes recomputes the letterbox from the two shapes, assuming it scaled up; without scaleup it is
        # given LetterBox's own ratio and padding, as ultralytics' validator passes them (ratio_pad)
        ratio_pad = None if kwargs.get("scaleup", True) else (got["ratio"][::-1], (got["left"], got["top"]))
        np.save(out / f"{name}.mapped.npy", scale_boxes(boxed.shape[:2], boxes.copy(), image.shape[:2], ratio_pad))
    (out / "params.json").write_text(json.dumps(params))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

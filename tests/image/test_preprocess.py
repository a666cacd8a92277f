"""Preprocessing held to the processors models ship with, run in the same test on real photos (scikit-image's
astronaut, coffee, chelsea and rocket, in its wheel): transformers' ViT, CLIP and ConvNeXt image processors (their
PIL backend; they need no torchvision) give the same pixel values bit for bit, and ultralytics' LetterBox (run in
the exporters' environment, which has it and OpenCV) the same padded uint8 image bit for bit, the same ratio and
padding, and the same boxes mapped back to the original image."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from soma_runtime.image.io import load_image
from soma_runtime.image.preprocess import (
    BICUBIC,
    BILINEAR,
    ImageProcessor,
    boxes_to_original,
    letterbox,
    letterbox_batch,
    resize_linear,
)

skimage_data = pytest.importorskip("skimage.data")
transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "image" / "letterbox_reference.py"
PYTHON = ROOT / ".venv-exporters" / "bin" / "python"
REFERENCE_TIMEOUT = 300
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


def photo(name: str) -> np.ndarray:
    return load_image(getattr(skimage_data, name)()).pixels


def test_skimage_photos_load_offline_as_rgb():
    for name in PHOTOS:
        pixels = photo(name)
        assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3, name


PROCESSORS = {
    "vit": ("ViTImageProcessorPil", {}),
    "clip": ("CLIPImageProcessorPil", {}),
    "clip-bilinear": ("CLIPImageProcessorPil", {"resample": BILINEAR}),
    "convnext-384": ("ConvNextImageProcessorPil", {}),
    "convnext-224-crop-pct": ("ConvNextImageProcessorPil", {"size": {"shortest_edge": 224}}),
    "vit-bicubic-rect": ("ViTImageProcessorPil", {"size": {"height": 160, "width": 288}, "resample": BICUBIC}),
}


@pytest.mark.parametrize("kind", list(PROCESSORS))
def test_processor_matches_transformers_image_processor_exactly(kind):
    """The same resampling (PIL, antialiased), crop and float arithmetic: equal to the last bit (a tolerance of
    0, tighter than the 1e-5 asked)."""
    cls, kwargs = PROCESSORS[kind]
    reference = getattr(transformers, cls)(**kwargs)
    ours = ImageProcessor.from_config(reference.to_dict())
    images = [photo(name) for name in PHOTOS]
    want = reference(images, return_tensors="np")["pixel_values"]
    got = ours.batch(images)
    assert got.dtype == want.dtype == np.float32
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_processor_from_config_reads_each_kind():
    clip = ImageProcessor.from_config(transformers.CLIPImageProcessorPil().to_dict())
    assert (clip.shortest_edge, clip.crop, clip.resample) == (224, (224, 224), BICUBIC)
    convnext = ImageProcessor.from_config(transformers.ConvNextImageProcessorPil().to_dict())
    assert (convnext.shortest_edge, convnext.crop_pct, convnext.crop) == (384, 0.875, None)
    vit = ImageProcessor.from_config(transformers.ViTImageProcessorPil().to_dict())
    assert (vit.size, vit.shortest_edge, vit.resample) == ((224, 224), None, BILINEAR)


def odd_image(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def letterbox_cases() -> dict:
    """name -> (image, LetterBox's keyword arguments): the photos at 640x640, odd and thin sizes (noise: every
    rounding shows), an exact halving (cv2 takes its area path there), no upscaling, and the stride-multiple
    rectangle (auto)."""
    square = {"new_shape": [640, 640], "auto": False, "scaleup": True}
    cases = {name: (photo(name), square) for name in PHOTOS}
    cases.update({
        "noise-333x517": (odd_image(333, 517, 1), square),
        "noise-1x1000": (odd_image(1, 1000, 2), square),
        "noise-1000x1": (odd_image(1000, 1, 3), square),
        "noise-1280x1280": (odd_image(1280, 1280, 4), square),
        "noise-37x41": (odd_image(37, 41, 5), square),
        "coffee-no-scaleup": (photo("coffee"), {"new_shape": [640, 640], "auto": False, "scaleup": False}),
        "chelsea-auto": (photo("chelsea"), {"new_shape": [640, 640], "auto": True, "stride": 32}),
        "rocket-320x480": (photo("rocket"), {"new_shape": [320, 480], "auto": False}),
    })
    return cases


def boxes_for(shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random xyxy boxes over a letterboxed image, some reaching into the padding (they get clipped)."""
    rng = np.random.default_rng(seed)
    h, w = shape
    xy = rng.uniform(-20, [w + 20, h + 20], (16, 2, 2)).astype(np.float32)
    return np.concatenate([xy.min(axis=1), xy.max(axis=1)], axis=1)


@pytest.fixture(scope="module")
def ultralytics_letterbox(tmp_path_factory) -> dict:
    """name -> (image, kwargs, ours, ultralytics' letterboxed image, its params, boxes, its mapped boxes)."""
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: `make setup` builds the exporters' environment")
    out = tmp_path_factory.mktemp("letterbox")
    cases = letterbox_cases()
    ours = {}
    for name, (image, kwargs) in cases.items():
        np.save(out / f"{name}.npy", image)
        box = letterbox(image, tuple(kwargs["new_shape"]), **{k: v for k, v in kwargs.items() if k != "new_shape"})
        ours[name] = box
        np.save(out / f"{name}.boxes.npy", boxes_for(box.pixels.shape[:2], len(name)))
    (out / "cases.json").write_text(json.dumps({name: kwargs for name, (_, kwargs) in cases.items()}))
    done = subprocess.run([str(PYTHON), str(SCRIPT), str(out)], check=False, capture_output=True, text=True,
                          timeout=REFERENCE_TIMEOUT, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    params = json.loads((out / "params.json").read_text())
    return {name: {"ours": ours[name], "image": cases[name][0], "want": np.load(out / f"{name}.letterbox.npy"),
                   "params": params[name], "boxes": np.load(out / f"{name}.boxes.npy"),
                   "mapped": np.load(out / f"{name}.mapped.npy")} for name in cases}


@pytest.mark.parametrize("name", list(letterbox_cases()))
def test_letterbox_equals_ultralytics_bit_for_bit(ultralytics_letterbox, name):
    """cv2's INTER_LINEAR reproduced with its 11-bit fixed-point weights and rounding: not one level apart."""
    case = ultralytics_letterbox[name]
    assert case["ours"].pixels.shape == case["want"].shape
    np.testing.assert_array_equal(case["ours"].pixels, case["want"])


@pytest.mark.parametrize("name", list(letterbox_cases()))
def test_letterbox_ratio_and_padding_equal_ultralytics(ultralytics_letterbox, name):
    case = ultralytics_letterbox[name]
    ours, params = case["ours"], case["params"]
    assert ours.ratio == params["ratio"][0]
    assert list(ours.resized[::-1]) == params["new_unpad"]
    assert list(ours.pad) == params["pad"]


@pytest.mark.parametrize("name", list(letterbox_cases()))
def test_boxes_map_back_to_original_pixels_as_ultralytics_scale_boxes(ultralytics_letterbox, name):
    case = ultralytics_letterbox[name]
    got = boxes_to_original(case["boxes"], case["ours"])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, case["mapped"], rtol=1e-6, atol=1e-3)


def test_resize_linear_of_the_same_size_is_the_image():
    image = odd_image(17, 23, 6)
    np.testing.assert_array_equal(resize_linear(image, (17, 23)), image)


def test_letterbox_batch_is_channels_first_in_unit_range():
    boxes = [letterbox(photo(name), 320) for name in ("coffee", "chelsea")]
    batch = letterbox_batch(boxes)
    assert batch.shape == (2, 3, 320, 320) and batch.dtype == np.float32
    np.testing.assert_array_equal(batch[1], np.moveaxis(boxes[1].pixels, -1, 0) / np.float32(255))

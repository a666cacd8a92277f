"""Preprocessing as vision models' own processors do it, to the value:
  - transformers' image processors (their PIL backend): resize through PIL with its antialiasing filters,
    a shortest-edge resize and a center crop (CLIP), ConvNeXt's crop_pct, rescale (uint8 * 1/255 in float64,
    then float32), normalize ((x - mean) / std in float32), channels first and a batch axis;
  - ultralytics' letterbox (LetterBox in ultralytics/data/augment.py): its ratio, rounding and padding, the
    resize done as OpenCV's INTER_LINEAR does it for uint8, reproduced bit for bit in numpy (half-pixel
    centres, no antialiasing, 11-bit fixed-point weights, cv2's own rounding), and the mapping of boxes
    found in a letterboxed image back to the original's pixels.
Takes images as Image.pixels gives them ([H, W, 3] uint8 RGB). Knows nothing of models' weights or graphs,
nor of hardware; OpenCV is not a dependency.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import PIL.Image

NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING = 0, 1, 2, 3, 4, 5   # PIL's resampling filters, by number
IMAGENET_STANDARD_MEAN = IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
CONVNEXT_WARP_EDGE = 384              # ConvNeXt at this shortest edge or above resizes to a square, uncropped
SHORTEST_EDGE_KINDS = ("CLIPImageProcessor", "ConvNextImageProcessor")   # an int `size` means a shortest edge

COEF_BITS = 11                        # cv2's INTER_RESIZE_COEF_BITS: uint8 bilinear weights are in 1/2048ths
ONE = 1 << COEF_BITS
LETTERBOX_PAD = 114                   # ultralytics' gray


def resize(pixels: np.ndarray, size: tuple[int, int], resample: int = BILINEAR) -> np.ndarray:
    """[H, W, C] uint8 resized to (height, width) by PIL (its filters widen when shrinking: antialiased),
    as transformers' resize calls it."""
    height, width = size
    resized = PIL.Image.fromarray(np.ascontiguousarray(pixels)).resize((width, height), resample=resample)
    return np.asarray(resized).reshape(height, width, -1)


def shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """(height, width) with the shorter side `edge` and the longer truncated to keep the aspect ratio
    (transformers' get_resize_output_image_size, default_to_square=False)."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def center_crop(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The centre (height, width) of [H, W, C] pixels; a side shorter than the crop is padded with zeros
    first, as transformers' center_crop does."""
    height, width = pixels.shape[:2]
    crop_h, crop_w = size
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    pad_top, pad_left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
    padded = np.zeros((new_h, new_w) + pixels.shape[2:], pixels.dtype)
    padded[pad_top:pad_top + height, pad_left:pad_left + width] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]


def rescale_normalize(pixels: np.ndarray, scale: float | None, mean, std) -> np.ndarray:
    """[H, W, C] pixels as float32 [C, H, W]: times `scale` (in float64, then float32), then (x - mean) / std
    in float32 (either step skipped when None), the arithmetic transformers' rescale and normalize do."""
    chw = np.moveaxis(pixels, -1, 0)
    x = (chw.astype(np.float64) * scale).astype(np.float32) if scale is not None else chw.astype(np.float32)
    if mean is not None:
        x = (x - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]
    return np.ascontiguousarray(x)


@dataclass(frozen=True)
class ImageProcessor:
    """One model's preprocessing as its transformers image processor (the PIL backend) does it: resize to
    `size` (height, width) or the shorter side to `shortest_edge`, center crop to `crop`, rescale, normalize.
    `crop_pct` is ConvNeXt's: below a shortest edge of 384 the image is resized to edge / crop_pct and
    cropped to edge x edge; at 384 or above it is resized to a square."""
    size: tuple[int, int] | None = (224, 224)
    shortest_edge: int | None = None
    crop: tuple[int, int] | None = None
    crop_pct: float | None = None
    resample: int = BILINEAR
    rescale: float | None = 1 / 255
    mean: tuple[float, ...] | None = IMAGENET_STANDARD_MEAN
    std: tuple[float, ...] | None = IMAGENET_STANDARD_STD

    @classmethod
    def from_config(cls, config: dict) -> ImageProcessor:
        """The preprocessing a preprocessor_config.json describes, as transformers writes one (every key
        present; ViTImageProcessor's defaults for any missing)."""
        kind = config.get("image_processor_type", "").removesuffix("Fast").removesuffix("Pil")
        size = config.get("size", {"height": 224, "width": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size} if kind in SHORTEST_EDGE_KINDS else {"height": size, "width": size}
        crop = config.get("crop_size") if config.get("do_center_crop") else None
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(size=(size["height"], size["width"]) if "height" in size else None,
                   shortest_edge=size.get("shortest_edge"),
                   crop=(crop["height"], crop["width"]) if crop else None,
                   crop_pct=config.get("crop_pct", 224 / 256) if kind == "ConvNextImageProcessor" else None,
                   resample=int(config.get("resample", BILINEAR)),
                   rescale=config.get("rescale_factor", 1 / 255) if config.get("do_rescale", True) else None,
                   mean=tuple(config.get("image_mean", IMAGENET_STANDARD_MEAN)) if config.get("do_normalize", True)
                   else None,
                   std=tuple(config.get("image_std", IMAGENET_STANDARD_STD)))

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every image this gives; None where it follows each image's shape (a shortest-edge
        resize without a crop)."""
        if self.crop_pct is not None and self.shortest_edge is not None:
            return self.crop or (self.shortest_edge, self.shortest_edge)
        if self.crop is not None:
            return self.crop
        return None if self.shortest_edge is not None else self.size

    def resized(self, pixels: np.ndarray) -> np.ndarray:
        """[H, W, C] uint8 resized and cropped, before rescaling."""
        height, width = pixels.shape[:2]
        if self.crop_pct is not None and self.shortest_edge is not None:
            edge = self.shortest_edge
            if edge >= CONVNEXT_WARP_EDGE:
                pixels = resize(pixels, (edge, edge), self.resample)
            else:
                pixels = resize(pixels, shortest_edge_size(height, width, int(edge / self.crop_pct)), self.resample)
                pixels = center_crop(pixels, (edge, edge))
        elif self.shortest_edge is not None:
            pixels = resize(pixels, shortest_edge_size(height, width, self.shortest_edge), self.resample)
        elif self.size is not None:
            pixels = resize(pixels, self.size, self.resample)
        return center_crop(pixels, self.crop) if self.crop is not None else pixels

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        """float32 [C, height, width] of one [H, W, C] uint8 image."""
        return rescale_normalize(self.resized(pixels), self.rescale, self.mean, self.std)

    def batch(self, images) -> np.ndarray:
        """float32 [B, C, height, width] of several images (the processor makes them one size)."""
        return np.stack([self(pixels) for pixels in images])


def linear_taps(src: int, dst: int, clamp: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """cv2's INTER_LINEAR taps along one axis: (first source index, second source index, their weights in
    1/2048ths) for each output. The output's centre maps to (i + 0.5) * src / dst - 0.5 in float32 (cv2's
    scale is 1 / (dst / src)); weights are rounded to nearest even. cv2 clamps columns (`clamp`): one before
    the first or past the last takes the edge pixel whole; rows keep their fraction over the edge row twice."""
    position = ((np.arange(dst) + 0.5) * (1.0 / (dst / src)) - 0.5).astype(np.float32)
    first = np.floor(position)
    fraction = position - first
    first = first.astype(np.int64)
    if clamp:
        outside = (first < 0) | (first >= src - 1)
        fraction[outside] = 0
        first = np.where(first < 0, 0, np.minimum(first, src - 1))
    w1 = np.rint(fraction * np.float32(ONE)).astype(np.int32)
    w0 = np.rint((np.float32(1) - fraction) * np.float32(ONE)).astype(np.int32)
    return np.clip(first, 0, src - 1), np.clip(first + 1, 0, src - 1), w0, w1


def resize_linear(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """[H, W] or [H, W, C] uint8 resized to (height, width) exactly as cv2.resize(..., INTER_LINEAR) does:
    each row resampled to sums of 11-bit weights, then rows combined as cv2's uint8 path rounds them,
    (((b0 * (r0 >> 4)) >> 16) + ((b1 * (r1 >> 4)) >> 16) + 2) >> 2. No antialiasing (as cv2)."""
    height, width = size
    x0, x1, a0, a1 = linear_taps(pixels.shape[1], width, clamp=True)
    y0, y1, b0, b1 = linear_taps(pixels.shape[0], height, clamp=False)
    planes = np.ascontiguousarray(pixels.reshape(pixels.shape[0], pixels.shape[1], -1))
    out = np.empty((height, width, planes.shape[2]), np.uint8)
    _resize_linear(planes, x0, x1, a0, a1, y0, y1, b0, b1, out)
    return out.reshape((height, width) + pixels.shape[2:])


@numba.njit(cache=True, nogil=True)
def _resize_linear(pixels, x0, x1, a0, a1, y0, y1, b0, b1, out):
    """resize_linear's arithmetic, output row by output row: its two source rows resampled across, then
    combined (each value's integers as cv2's: no sum exceeds 31 bits)."""
    width, channels = out.shape[1], out.shape[2]
    top = np.empty((width, channels), np.int32)
    bottom = np.empty((width, channels), np.int32)
    for i in range(out.shape[0]):
        for j in range(width):
            for c in range(channels):
                top[j, c] = (np.int32(pixels[y0[i], x0[j], c]) * a0[j] + np.int32(pixels[y0[i], x1[j], c]) * a1[j]) >> 4
                bottom[j, c] = (np.int32(pixels[y1[i], x0[j], c]) * a0[j] + np.int32(pixels[y1[i], x1[j], c]) * a1[j]) >> 4
        for j in range(width):
            for c in range(channels):
                out[i, j, c] = (((b0[i] * top[j, c]) >> 16) + ((b1[i] * bottom[j, c]) >> 16) + 2) >> 2


@dataclass(frozen=True)
class Letterbox:
    """A letterboxed image and how it was made: `pixels` the resized image inside its padding, `original`
    and `resized` (height, width) before and after resizing, `pad` (top, bottom, left, right) pixels, and
    `ratio` the scale ultralytics chose (min of new / old over both sides)."""
    pixels: np.ndarray
    original: tuple[int, int]
    resized: tuple[int, int]
    pad: tuple[int, int, int, int]
    ratio: float


def letterbox(pixels: np.ndarray, new_shape=(640, 640), *, auto: bool = False, scale_fill: bool = False,
              scaleup: bool = True, center: bool = True, stride: int = 32, pad_value: int = LETTERBOX_PAD) -> Letterbox:
    """ultralytics' LetterBox on [H, W, C] uint8 pixels: scaled by r = min(new_h / h, new_w / w) (never above
    1 unless `scaleup`), each side round(side * r) (at least 1), resized by cv2's INTER_LINEAR, and padded with
    `pad_value` to `new_shape` (to the next multiple of `stride` with `auto`; stretched, unpadded, with
    `scale_fill`), the padding split round(d / 2 - 0.1) before and round(d / 2 + 0.1) after (all after when
    not `center`)."""
    new_h, new_w = (new_shape, new_shape) if isinstance(new_shape, int) else new_shape
    height, width = pixels.shape[:2]
    ratio = min(new_h / height, new_w / width)
    if not scaleup:
        ratio = min(ratio, 1.0)
    unpad_w, unpad_h = max(round(width * ratio), 1), max(round(height * ratio), 1)
    dw, dh = new_w - unpad_w, new_h - unpad_h
    if auto:
        dw, dh = dw % stride, dh % stride
    elif scale_fill:
        dw, dh, unpad_w, unpad_h = 0, 0, new_w, new_h
    if center:
        dw, dh = dw / 2, dh / 2
    top, bottom = round(dh - 0.1) if center else 0, round(dh + 0.1)
    left, right = round(dw - 0.1) if center else 0, round(dw + 0.1)
    resized = pixels if (height, width) == (unpad_h, unpad_w) else resize_linear(pixels, (unpad_h, unpad_w))
    padded = np.full((unpad_h + top + bottom, unpad_w + left + right) + pixels.shape[2:], pad_value, np.uint8)
    padded[top:top + unpad_h, left:left + unpad_w] = resized
    return Letterbox(padded, (height, width), (unpad_h, unpad_w), (top, bottom, left, right), ratio)


def letterbox_batch(boxes: list[Letterbox]) -> np.ndarray:
    """float32 [B, C, H, W] in [0, 1] of letterboxed images of one size, as ultralytics feeds its models
    (pixels / 255)."""
    return np.stack([np.moveaxis(box.pixels, -1, 0) for box in boxes]).astype(np.float32) / np.float32(255)


def boxes_to_original(boxes: np.ndarray, box: Letterbox) -> np.ndarray:
    """[..., 4] (x1, y1, x2, y2) boxes in a letterboxed image's pixels mapped to the original image's: the
    padding taken off, each axis divided by its own gain (resized / original side, as ultralytics'
    scale_boxes does, since the sides were rounded apart), clipped to the original image."""
    boxes = np.asarray(boxes)
    out = boxes.astype(np.result_type(boxes.dtype, np.float32), copy=True)
    top, _, left, _ = box.pad
    gain_y, gain_x = box.resized[0] / box.original[0], box.resized[1] / box.original[1]
    out[..., [0, 2]] = ((out[..., [0, 2]] - left) / gain_x).clip(0, box.original[1])
    out[..., [1, 3]] = ((out[..., [1, 3]] - top) / gain_y).clip(0, box.original[0])
    return out

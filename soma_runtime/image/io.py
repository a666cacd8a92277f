"""Images in: JPEG, PNG, WebP, BMP and GIF (its first frame) decoded through Pillow, from a path, the file's
bytes, a numpy array, a PIL image or an OpenAI `image_url` (a base64 `data:` URL; a local path only where the
caller allows files; never the network). EXIF orientation is applied (ImageOps.exif_transpose) and every
image made RGB as transformers' convert_to_rgb does: an image with an alpha band or a transparency key is
composited on white, any other through Image.convert("RGB") (gray repeated, palettes looked up, CMYK
converted). Knows nothing of models, processors or hardware.

What one image may cost is bounded before a pixel is decoded:
  MAX_BYTES   the largest encoded image read (a file, bytes, a data: URL's payload), 20 MiB
  MAX_PIXELS  the most pixels decoded, 40 megapixels, from the size its header states (a PNG that
              claims 30000x30000 is refused without allocating it; a WebP's canvas is read here, since
              Pillow's WebP decoder allocates it on opening)
Only the first frame of a GIF (or an animated WebP, or a camera's MPO JPEG) is decoded; the frame count is
never asked for, since that walks the whole file. Pillow's ImageFile.LOAD_TRUNCATED_IMAGES stays False: a
file cut short is an error, not gray pixels. Every refusal is a RequestError (a 400 at the server) naming
the image and what was wrong with it.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import re
import struct
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

import numpy as np
import PIL.Image
import PIL.ImageOps

from soma_runtime.errors import RequestError

MAX_BYTES = 20 << 20
MAX_PIXELS = 40_000_000
FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")            # Pillow's names for the formats decoded
FORMAT_NAMES = "JPEG, PNG, WebP, BMP or GIF"
SAME_FORMAT = {"MPO": "JPEG"}                              # Pillow names a JPEG with a multi-picture index MPO
MEDIA_TYPES = {"image/jpeg": "JPEG", "image/jpg": "JPEG", "image/png": "PNG", "image/webp": "WEBP",
               "image/bmp": "BMP", "image/x-ms-bmp": "BMP", "image/gif": "GIF"}
URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")   # two letters at least: C:\ is a path
WHITE = (255, 255, 255, 255)
DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)   # what Pillow's decoders raise


@dataclass(frozen=True)
class Image:
    """A decoded image: `pixels` [height, width, 3] uint8 RGB (read-only), upright (EXIF orientation
    applied), and the format it was decoded from (None for an array or a PIL image given decoded)."""
    pixels: np.ndarray
    format: str | None = None

    @property
    def size(self) -> tuple[int, int]:
        """(height, width): the original image's size, the one boxes found in it are given back in."""
        return self.pixels.shape[0], self.pixels.shape[1]


def load_image(source, *, allow_files: bool = True, max_bytes: int = MAX_BYTES, max_pixels: int = MAX_PIXELS,
               name: str = "image") -> Image:
    """An Image of a path, the file's bytes, a numpy array ([H, W, 3] uint8 RGB or [H, W] uint8 gray), a PIL
    image, or a URL string as load_image_url takes one. A library call may read files; a request's image
    goes through load_image_url, where files are refused unless the server allows them."""
    if isinstance(source, Image):
        return source
    if isinstance(source, np.ndarray):
        return Image(pixels_of_array(source, name, max_pixels))
    if isinstance(source, PIL.Image.Image):
        check_pixels(source.size, name, max_pixels)
        try:
            return Image(upright_rgb(source, name))
        except DECODE_ERRORS as e:
            raise RequestError(f"{name}: a damaged or truncated image that cannot be decoded ({e})") from None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode(bytes(source), name, max_bytes, max_pixels)
    if isinstance(source, str) and URL_SCHEME.match(source):
        return load_image_url(source, allow_files=allow_files, max_bytes=max_bytes, max_pixels=max_pixels, name=name)
    if isinstance(source, (str, os.PathLike)):
        if not allow_files:
            raise RequestError(f"{name}: reading local files is not allowed here; send the image as a data: URL")
        path = os.fspath(source)
        return decode(read_file(path, name if name != "image" else path, max_bytes), path, max_bytes, max_pixels)
    raise RequestError(f"{name}: an image is a path, the file's bytes, a numpy array, a PIL image or a data: URL, "
                       f"got {type(source).__name__}")


def load_image_url(url, *, allow_files: bool = False, max_bytes: int = MAX_BYTES, max_pixels: int = MAX_PIXELS,
                   name: str = "image_url") -> Image:
    """An Image of an OpenAI `image_url` (the URL string or its {"url": ...} object): a base64 `data:` URL
    whose media type must be the bytes' format; a `file://` URL or a plain path only with `allow_files`;
    http(s) and any other scheme refused (nothing is fetched from the network)."""
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise RequestError(f"{name}: an image URL is a non-empty string, got {type(url).__name__}")
    scheme = URL_SCHEME.match(url)
    scheme = scheme.group(1).lower() if scheme else None
    if scheme == "data":
        media, payload = data_url_payload(url, name, max_bytes)
        return decode(payload, name, max_bytes, max_pixels, declared=media)
    if scheme in ("http", "https"):
        raise RequestError(f"{name}: {scheme} URLs are not fetched (no network access here); send the image as a "
                           f"base64 data: URL")
    if scheme not in (None, "file"):
        raise RequestError(f"{name}: {scheme}: URLs are not taken; send the image as a base64 data: URL")
    if not allow_files:
        raise RequestError(f"{name}: reading local files is not allowed here; send the image as a data: URL")
    path = unquote(urlparse(url).path) if scheme == "file" else url
    return decode(read_file(path, path, max_bytes), path, max_bytes, max_pixels)


def data_url_payload(url: str, name: str, max_bytes: int) -> tuple[str, bytes]:
    """(the media type a `data:<media type>;base64,<payload>` URL declares, one of MEDIA_TYPES; its payload)."""
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise RequestError(f"{name}: a data: URL without a comma before its payload")
    media, *params = [part.strip().lower() for part in header.split(";")]
    if "base64" not in params:
        raise RequestError(f"{name}: only base64 data: URLs are taken (data:image/png;base64,...)")
    if media not in MEDIA_TYPES:
        raise RequestError(f"{name}: a data: URL of {media or 'no media type'}; taken are "
                           f"{', '.join(sorted(set(MEDIA_TYPES) - {'image/jpg', 'image/x-ms-bmp'}))}")
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise RequestError(f"{name}: about {len(payload) // 4 * 3} bytes, more than the {max_bytes} taken")
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{name}: its data: URL's payload is not valid base64 ({e})") from None
    return media, data


def read_file(path: str, name: str, max_bytes: int) -> bytes:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise RequestError(f"{name}: {size} bytes, more than the {max_bytes} taken")
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise RequestError(f"{name}: cannot read ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise RequestError(f"{name}: more than the {max_bytes} bytes taken")
    return data


def check_pixels(size: tuple[int, int], name: str, max_pixels: int) -> None:
    """RequestError for an image of (width, height) `size` with no pixels or more than `max_pixels`."""
    width, height = size
    if width < 1 or height < 1:
        raise RequestError(f"{name}: an image of {width}x{height} pixels holds none")
    if width * height > max_pixels:
        raise RequestError(f"{name}: {width}x{height} pixels, more than the {max_pixels} decoded")


def decode(data: bytes, name: str, max_bytes: int, max_pixels: int, declared: str | None = None) -> Image:
    """The first frame of an encoded image, upright and RGB; its size is checked from its header before
    a pixel is decoded, and its format against the media type `declared` (a data: URL's) where one is."""
    if len(data) > max_bytes:
        raise RequestError(f"{name}: {len(data)} bytes, more than the {max_bytes} taken")
    if not data:
        raise RequestError(f"{name}: empty (no bytes)")
    if (size := webp_canvas(data)) is not None:
        check_pixels(size, name, max_pixels)       # Pillow's WebP decoder allocates its canvas when opened
    try:
        with PIL.Image.open(io.BytesIO(data), formats=FORMATS) as image:
            found = SAME_FORMAT.get(image.format, image.format)
            if declared is not None and found != MEDIA_TYPES[declared]:
                raise RequestError(f"{name}: its data: URL declares {declared}, its bytes are a {found} image")
            check_pixels(image.size, name, max_pixels)
            image.load()
            return Image(upright_rgb(image, name), found)
    except PIL.UnidentifiedImageError:
        what = "an SVG (vector images are not taken)" if looks_like_svg(data) else "not an image Pillow identifies"
        raise RequestError(f"{name}: {what}; taken are {FORMAT_NAMES}") from None
    except PIL.Image.DecompressionBombError as e:
        raise RequestError(f"{name}: more pixels than the {max_pixels} decoded ({e})") from None
    except DECODE_ERRORS as e:
        raise RequestError(f"{name}: a damaged or truncated image that cannot be decoded ({e})") from None


def webp_canvas(data: bytes) -> tuple[int, int] | None:
    """(width, height) a WebP file's first chunk states (VP8X's canvas, VP8L's or VP8's frame); None for
    anything else."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk, body = data[12:16], data[20:30]
    if chunk == b"VP8X":
        return 1 + int.from_bytes(body[4:7], "little"), 1 + int.from_bytes(body[7:10], "little")
    if chunk == b"VP8L":
        bits = int.from_bytes(body[1:5], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 ":
        return int.from_bytes(body[6:8], "little") & 0x3FFF, int.from_bytes(body[8:10], "little") & 0x3FFF
    return None


def looks_like_svg(data: bytes) -> bool:
    head = data[:1024].lstrip().lower()
    return head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in head)


def upright_rgb(image: PIL.Image.Image, name: str) -> np.ndarray:
    """A PIL image's pixels turned as its EXIF orientation says, as read-only [H, W, 3] uint8 RGB:
    transparency composited on white (transformers' convert_to_rgb), anything else converted."""
    image = PIL.ImageOps.exif_transpose(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = PIL.Image.alpha_composite(PIL.Image.new("RGBA", rgba.size, WHITE), rgba).convert("RGB")
    else:
        image = image.convert("RGB")
    pixels = np.array(image, dtype=np.uint8)
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise RequestError(f"{name}: did not convert to RGB (got an array of shape {list(pixels.shape)})")
    pixels.flags.writeable = False
    return pixels


def pixels_of_array(array: np.ndarray, name: str, max_pixels: int) -> np.ndarray:
    """A copy of [H, W, 3] uint8 RGB or [H, W] uint8 gray (repeated into three channels), read-only."""
    if array.dtype != np.uint8:
        raise RequestError(f"{name}: an image array is uint8, got {array.dtype}")
    if array.ndim in (2, 3):
        check_pixels((array.shape[1], array.shape[0]), name, max_pixels)
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    elif array.ndim == 3 and array.shape[2] == 3:
        array = np.array(array, copy=True)
    else:
        raise RequestError(f"{name}: an image array is [height, width, 3] RGB or [height, width] gray, "
                           f"got shape {list(array.shape)}")
    array.flags.writeable = False
    return array

"""Images a request sends: one as `image` or a list as `images`, each a base64 `data:` URL or the bare base64 of
the file, decoded by image/io (never a local file, never the network; a bad image is a 400). The image routes'
request bodies (detections, image classifications) take their fields from ImagesRequest."""
from __future__ import annotations

import base64
import binascii

from pydantic import BaseModel, ConfigDict, Field

from soma_runtime.errors import RequestError
from soma_runtime.image.io import MAX_BYTES, URL_SCHEME, Image, load_image, load_image_url

MAX_IMAGES = 64                   # images one request may send (as many as an image task takes a call)


class ImagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    image: str | None = None
    images: list[str] | None = Field(None, min_length=1, max_length=MAX_IMAGES)

    def check_images(self) -> None:
        if (self.image is None) == (self.images is None):
            raise RequestError("send one image as `image` or a list as `images` (a data: URL or base64 each)")

    def decoded(self) -> list[Image]:
        """The images, decoded, each named by its field in errors."""
        if self.images is None:
            return [image_of(self.image, "image")]
        return [image_of(text, f"images[{i}]") for i, text in enumerate(self.images)]


def image_of(text: str, name: str) -> Image:
    """An image sent as a `data:` URL, or as the bare base64 of its file (no local paths, no other URLs)."""
    if URL_SCHEME.match(text):
        return load_image_url(text, allow_files=False, name=name)
    if len(text) // 4 * 3 > MAX_BYTES + 3:
        raise RequestError(f"{name}: about {len(text) // 4 * 3} bytes, more than the {MAX_BYTES} taken")
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{name}: an image is a data: URL or the base64 of an image file; this is neither") from None
    return load_image(data, allow_files=False, name=name)

"""Images in and out of the gateway: the decoded image array turned into what the client asked
for (PNG, JPEG, WebP), and a client's starting image (image-to-image) read back into pixels."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from stagemesh.core import codec, formats
from stagemesh.core.errors import InvalidArgument
from stagemesh.core.params import OUTPUT_PNG, InitImage, Limits

INIT_IMAGE_FIELD = "params.init_image"
# What a starting image may be encoded as (Pillow's names); no other decoder sees the bytes.
INIT_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def to_uint8(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] float in [0, 1] -> uint8 (codec.to_pixels); uint8 pixels pass as they are."""
    return codec.to_pixels(image)


def encode(image: np.ndarray, output_format: str, quality: int) -> bytes:
    """[H, W, 3] float in [0, 1] as PNG, or as JPEG / WebP at `quality` (1-100)."""
    fmt = formats.by_name(output_format)
    pixels = np.ascontiguousarray(to_uint8(image))
    buffer = io.BytesIO()
    options = {"quality": quality} if fmt.lossy else {}
    Image.fromarray(pixels).save(buffer, format=fmt.pillow, **options)
    return buffer.getvalue()


def encode_png(image: np.ndarray) -> bytes:
    return encode(image, OUTPUT_PNG, 0)


def _refuse(reason: str) -> InvalidArgument:
    return InvalidArgument.field(INIT_IMAGE_FIELD, f"{reason}; allowed: a PNG, JPEG or WebP image")


def _open(data: bytes) -> Image.Image:
    """Only PNG, JPEG and WebP readers look at the bytes; the header alone is read."""
    try:
        return Image.open(io.BytesIO(data), formats=INIT_IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise _refuse(f"declares more pixels than any allowed image (a decompression bomb): {exc}") from None
    except (OSError, SyntaxError, ValueError):  # Pillow's UnidentifiedImageError is an OSError
        raise _refuse(f"{len(data)} bytes that are not a PNG, JPEG or WebP image") from None


def probe_init_image(data: bytes, limits: Limits) -> InitImage:
    """The starting image's size from its header, refused before any pixel is decoded when it is
    no PNG, JPEG or WebP image or larger than the largest image the pipeline draws (so a small
    file declaring a huge picture is never inflated). Its sides are checked against the pixel
    multiple with the other parameters (core.params.resolve)."""
    with _open(data) as image:
        width, height = image.size
    top = limits.max_pixels_side
    if width > top or height > top:
        raise InvalidArgument.field(
            INIT_IMAGE_FIELD,
            f"is {width}x{height} pixels; allowed: width and height multiples of {limits.pixel_multiple} up to {top}",
        )
    return InitImage(width, height, data)


def decode_init_image(image: InitImage) -> np.ndarray:
    """The probed starting image's pixels, uint8 [height, width, 3] RGB (alpha dropped; an
    animation's first frame). Blocks for as long as decoding takes: run it off the event loop."""
    with _open(image.data) as opened:
        try:
            rgb = opened.convert("RGB")  # decodes
        except (OSError, SyntaxError, ValueError) as exc:
            raise _refuse(f"cannot be decoded ({exc})") from None
    if rgb.size != (image.width, image.height):
        declared = f"{image.width}x{image.height}"
        raise _refuse(f"decodes to {rgb.size[0]}x{rgb.size[1]} pixels, not the {declared} it declares")
    return np.array(rgb, dtype=np.uint8)

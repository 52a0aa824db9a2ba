"""The GenerationParams a client sends, built from its keyword arguments."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeAlias

from stagemesh.core import converters, formats
from stagemesh.v1 import generation_pb2

if TYPE_CHECKING:
    from PIL import Image

OutputFormat: TypeAlias = Literal["png", "jpeg", "webp", "tensor"]
# Encoded bytes, a path to an image file, or a PIL image (sent as PNG).
InitImage: TypeAlias = "bytes | bytearray | memoryview | str | os.PathLike[str] | Image.Image"


def generation_params(
    prompt: str,
    *,
    width: int | None = None,
    height: int | None = None,
    steps: int | None = None,
    guidance_scale: float | None = None,
    seed: int | None = None,
    negative_prompt: str | None = None,
    num_images: int | None = None,
    output_format: OutputFormat = "png",
    quality: int | None = None,
    init_image: InitImage | None = None,
    strength: float | None = None,
) -> generation_pb2.GenerationParams:
    """Unset (None) fields stay unset: the gateway applies its defaults and checks the ranges."""
    if output_format not in formats.NAMES:
        raise ValueError(f"output_format = {output_format!r}: allowed {', '.join(map(repr, formats.NAMES))}")
    params = generation_pb2.GenerationParams(
        prompt=prompt, output_format=converters.output_format_to_proto(output_format)
    )
    for name, value in (
        ("width", width),
        ("height", height),
        ("num_inference_steps", steps),
        ("guidance_scale", guidance_scale),
        ("seed", seed),
        ("negative_prompt", negative_prompt),
        ("num_images", num_images),
        ("quality", quality),
        ("strength", strength),
    ):
        if value is not None:
            setattr(params, name, value)
    if init_image is not None:
        params.init_image = init_image_bytes(init_image)
    return params


def init_image_bytes(image: InitImage) -> bytes:
    """The encoded bytes of an init_image: given as bytes, read from a path, or a PIL image as PNG."""
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    if isinstance(image, str | os.PathLike):
        return Path(image).expanduser().read_bytes()
    pil = sys.modules.get("PIL.Image")  # a PIL image exists only once PIL was imported
    if pil is not None and isinstance(image, pil.Image):
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()
    raise TypeError(f"init_image: {type(image).__name__} is none of bytes, a path or a PIL image")

"""The keywords of a client's generate() and the GenerationParams built from them."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Required, TypeAlias, TypedDict, Unpack

from stagemesh.core import converters, formats
from stagemesh.v1 import generation_pb2

if TYPE_CHECKING:
    from PIL import Image

OutputFormat: TypeAlias = Literal["png", "jpeg", "webp", "tensor"]
VideoFormat: TypeAlias = Literal["mp4", "webp", "tensor"]
# Encoded bytes, a path to an image file, or a PIL image (sent as PNG).
InitImage: TypeAlias = "bytes | bytearray | memoryview | str | os.PathLike[str] | Image.Image"
# LoRA adapters by name: {name: scale}, or names (scale 1.0) and (name, scale) pairs.
Adapters: TypeAlias = "Mapping[str, float] | Sequence[str | tuple[str, float]]"
DEFAULT_OUTPUT_FORMAT: OutputFormat = "png"


class _Options(TypedDict, total=False):
    """Every keyword of generate() but num_images, which decides what it returns."""

    width: int | None
    height: int | None
    steps: int | None  # num_inference_steps
    guidance_scale: float | None
    seed: int | None
    negative_prompt: str | None
    output_format: OutputFormat  # DEFAULT_OUTPUT_FORMAT when left out
    quality: int | None
    init_image: InitImage | None
    strength: float | None
    adapters: Adapters | None
    # Step caching for this request where the denoising stage offers it ("off", "first_block",
    # "taylorseer", "mag"); None: the stage's own setting.
    step_cache: str | None
    step_cache_threshold: float | None
    # The call's own, not GenerationParams' fields.
    request_id: str | None
    timeout: float | None


class GenerateOptions(_Options, total=False):
    """The keywords of Client.generate and AsyncClient.generate beside the prompt (docs/API.md,
    "Python client"): each one left out, or None, leaves its field to the gateway's default."""

    num_images: int | None


class OneImageOptions(_Options, total=False):
    """generate()'s keywords when they ask for one image (a GenerationResult)."""

    num_images: None


class ImageListOptions(_Options, total=False):
    """generate()'s keywords when they give num_images (a list of GenerationResult)."""

    num_images: Required[int]


class VideoOptions(TypedDict, total=False):
    """The keywords of Client.generate_video and AsyncClient.generate_video beside the prompt:
    each one left out, or None, leaves its field to the gateway's (the model's) default."""

    num_frames: int | None
    fps: int | None
    width: int | None
    height: int | None
    steps: int | None  # num_inference_steps
    guidance_scale: float | None
    seed: int | None
    negative_prompt: str | None
    output_format: VideoFormat  # "mp4" when left out
    quality: int | None
    init_image: InitImage | None  # the first frame (image-to-video models)
    request_id: str | None
    timeout: float | None


KEYWORDS = GenerateOptions.__optional_keys__ | GenerateOptions.__required_keys__
VIDEO_KEYWORDS = VideoOptions.__optional_keys__
# Keywords that name a GenerationParams field otherwise.
_FIELD_NAMES = {"steps": "num_inference_steps"}
# Keywords that are not set on GenerationParams as they are given.
_NOT_COPIED = frozenset({"output_format", "init_image", "adapters", "request_id", "timeout"})


def generation_params(prompt: str, **options: Unpack[GenerateOptions]) -> generation_pb2.GenerationParams:
    """Unset (None) fields stay unset: the gateway applies its defaults and checks the ranges.
    request_id and timeout are the caller's to send."""
    unknown = sorted(options.keys() - KEYWORDS)
    if unknown:
        # As Python refuses a keyword a signature does not name; `**options` would take any.
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
    output_format = options.get("output_format", DEFAULT_OUTPUT_FORMAT)
    if output_format not in formats.NAMES:
        raise ValueError(f"output_format = {output_format!r}: allowed {', '.join(map(repr, formats.NAMES))}")
    params = generation_pb2.GenerationParams(
        prompt=prompt, output_format=converters.output_format_to_proto(output_format)
    )
    for keyword, value in options.items():
        if value is not None and keyword not in _NOT_COPIED:
            setattr(params, _FIELD_NAMES.get(keyword, keyword), value)
    init_image = options.get("init_image")
    if init_image is not None:
        params.init_image = init_image_bytes(init_image)
    params.adapters.extend(adapter_choices(options.get("adapters")))
    return params


def adapter_choices(adapters: Adapters | None) -> list[generation_pb2.AdapterChoice]:
    """GenerationParams.adapters from {name: scale}, names, or (name, scale) pairs."""
    if adapters is None:
        return []
    if isinstance(adapters, str):
        raise TypeError(f"adapters: give a list of names or a {{name: scale}} mapping, not the string {adapters!r}")
    pairs = (
        adapters.items() if isinstance(adapters, Mapping) else ((a, 1.0) if isinstance(a, str) else a for a in adapters)
    )
    return [generation_pb2.AdapterChoice(name=name, scale=float(scale)) for name, scale in pairs]


def video_params(prompt: str, **options: Unpack[VideoOptions]) -> generation_pb2.GenerationParams:
    """generate_video()'s GenerationParams; unset (None) fields stay unset."""
    unknown = sorted(options.keys() - VIDEO_KEYWORDS)
    if unknown:
        raise TypeError(f"generate_video() got an unexpected keyword argument {unknown[0]!r}")
    output_format = options.get("output_format", formats.DEFAULT_VIDEO.name)
    if output_format not in formats.VIDEO_NAMES:
        raise ValueError(f"output_format = {output_format!r}: allowed {', '.join(map(repr, formats.VIDEO_NAMES))}")
    params = generation_pb2.GenerationParams(
        prompt=prompt, output_format=converters.output_format_to_proto(output_format)
    )
    for keyword, value in options.items():
        if value is not None and keyword not in _NOT_COPIED:
            setattr(params, _FIELD_NAMES.get(keyword, keyword), value)
    init_image = options.get("init_image")
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

"""Generation parameters: defaults and validation against a stage's limits.

Shared by the gateway (refuses bad input before any stage is called) and the stage service
(which never trusts its caller). Violations name the field and the allowed range.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from stagemesh.core.errors import FieldViolation, InvalidArgument

OUTPUT_PNG = "png"
OUTPUT_TENSOR = "tensor"
# The id travels to every stage as x-request-id metadata: printable ASCII, bounded.
MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True)
class Limits:
    pixel_multiple: int = 16
    max_pixels_side: int = 1024
    max_inference_steps: int = 100
    max_prompt_bytes: int = 2048
    default_size: int = 256
    default_inference_steps: int = 8
    default_guidance_scale: float = 4.0
    max_guidance_scale: float = 30.0


# What requests sampled together must share, in the order of Params.batch_key().
BATCH_KEY_FIELDS = ("width", "height", "num_inference_steps", "guidance_scale", "strength")


@dataclass(frozen=True)
class Params:
    prompt: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    output_format: str
    # What the image should not show; "" means none (the pipeline's own unconditional input).
    negative_prompt: str = ""
    # Images from one request; image i is drawn with seed + i.
    num_images: int = 1
    # JPEG/WebP quality, 1-100.
    quality: int = 90
    # Image-to-image: how far from the starting image, in (0, 1]; None means text-to-image.
    strength: float | None = None

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one diffusion batch (or one DP wave)."""
        return tuple(getattr(self, name) for name in BATCH_KEY_FIELDS)


def check_request_id(value: str) -> None:
    """A client's own request id must be sendable as gRPC metadata to every hop."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument.field("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters (got {len(value)})")
    if not all(" " <= c <= "~" for c in value):
        raise InvalidArgument.field(
            "request_id", "printable ASCII only (0x20-0x7E): it is sent on as x-request-id metadata"
        )


def _check_side(name: str, value: int, limits: Limits, out: list[FieldViolation]) -> None:
    m, top = limits.pixel_multiple, limits.max_pixels_side
    allowed = f"allowed: multiples of {m} from {m} to {top}"
    if value <= 0:
        out.append(FieldViolation(name, f"must be positive, got {value}; {allowed}"))
    elif value > top:
        out.append(FieldViolation(name, f"{value} is above the maximum {top}; {allowed}"))
    elif value % m:
        out.append(FieldViolation(name, f"{value} is not a multiple of {m}; {allowed}"))


def resolve(
    *,
    prompt: str,
    width: int | None,
    height: int | None,
    num_inference_steps: int | None,
    guidance_scale: float | None,
    seed: int | None,
    output_format: str,
    limits: Limits,
) -> Params:
    """Fill defaults (None means default) and validate; raises InvalidArgument listing every bad field."""
    violations: list[FieldViolation] = []
    width = limits.default_size if width is None else width
    height = limits.default_size if height is None else height
    steps = limits.default_inference_steps if num_inference_steps is None else num_inference_steps
    guidance = limits.default_guidance_scale if guidance_scale is None else float(guidance_scale)

    prompt_bytes = len(prompt.encode("utf-8", errors="surrogatepass"))
    if prompt_bytes > limits.max_prompt_bytes:
        violations.append(
            FieldViolation(
                "params.prompt", f"is {prompt_bytes} bytes; allowed: at most {limits.max_prompt_bytes} UTF-8 bytes"
            )
        )
    _check_side("params.width", width, limits, violations)
    _check_side("params.height", height, limits, violations)
    if not 1 <= steps <= limits.max_inference_steps:
        violations.append(
            FieldViolation(
                "params.num_inference_steps", f"{steps} is out of range; allowed: 1 to {limits.max_inference_steps}"
            )
        )
    if not (math.isfinite(guidance) and 1.0 <= guidance <= limits.max_guidance_scale):
        violations.append(
            FieldViolation(
                "params.guidance_scale", f"{guidance} is out of range; allowed: 1.0 to {limits.max_guidance_scale}"
            )
        )
    if output_format not in (OUTPUT_PNG, OUTPUT_TENSOR):
        violations.append(
            FieldViolation("params.output_format", f"unknown output format {output_format!r}; allowed: PNG, TENSOR")
        )
    if violations:
        raise InvalidArgument(violations)
    return Params(
        prompt=prompt,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=secrets.randbits(63) if seed is None else int(seed),
        output_format=output_format,
    )

"""The OpenAI Images API's shapes (requests, responses, stream events) and the converters between
them and stagemesh.v1 GenerationParams / GenerationResult.

Fields OpenAI defines that this server cannot honour are refused naming the field (`url`
responses, transparent backgrounds, masks) or accepted and left unused where the request stays
meaningful without them (`user`, `quality`, `moderation`, `style`, ...). Beyond OpenAI's fields,
the generation knobs of GenerationParams are accepted as extensions: seed, negative_prompt,
num_inference_steps, guidance_scale, strength, adapters. Any other field is refused, as OpenAI does.
"""

from __future__ import annotations

import base64
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stagemesh.core import converters, errors, formats
from stagemesh.v1 import control_pb2, generation_pb2

# The mesh serves one pipeline: GET /v1/models lists it under this id, then each LoRA adapter by its
# name; a request's `model` is this id, an adapter's name (that adapter at scale 1), or left out.
MODEL_ID = "stagemesh"
MAX_SEED = 2**64 - 1  # GenerationParams.seed is a uint64
_SIZE = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")
# GenerationParams' field names in domain errors -> the HTTP request's names.
_HTTP_PARAMS = {
    "width": "size",
    "height": "size",
    "num_images": "n",
    "quality": "output_compression",
    "init_image": "image",
    "request_id": "x-request-id",
}


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    scale: float = 1.0


class ImageRequest(BaseModel):
    """Fields shared by /v1/images/generations (JSON) and /v1/images/edits (multipart form)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    n: int | None = Field(default=None, ge=1)
    size: str | None = None  # "WIDTHxHEIGHT" or "auto" (the service default)
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: int | None = Field(default=None, ge=0, le=100)
    model: str | None = None
    stream: bool | None = None
    background: Literal["auto", "opaque", "transparent"] | None = None
    partial_images: int | None = Field(default=None, ge=0, le=3)  # none are sent: progress events instead
    # Accepted and not used: the pipeline has one quality and no moderation or prompt rewriting.
    quality: str | None = None
    moderation: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # Extensions: GenerationParams' own knobs.
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    strength: float | None = None
    # LoRA adapters with their scales, several at once (`model` selects one at scale 1).
    adapters: list[AdapterBody] | None = None


class GenerationRequest(ImageRequest):
    style: str | None = None  # accepted and not used


class EditRequest(ImageRequest):
    input_fidelity: str | None = None  # accepted and not used


class SleepBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage_ids: list[int] = []  # empty is refused by the control plane, naming the allowed ids
    level: int | None = None  # 1 or 2; unset: 2


class WakeUpBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage_ids: list[int] = []


def http_param(domain_field: str) -> str:
    """The HTTP request's name of a field a domain error names (`params.width` -> `size`)."""
    name = domain_field.removeprefix("params.")
    return _HTTP_PARAMS.get(name, name)


def parse_size(text: str | None) -> tuple[int, int] | None:
    if text is None or text == "auto":
        return None
    match = _SIZE.match(text)
    if not match:
        raise errors.InvalidArgument.field(
            "size", f"{text!r} is not a size; allowed: 'WIDTHxHEIGHT' in pixels (e.g. '256x256') or 'auto'"
        )
    return int(match.group(1)), int(match.group(2))


def check_unsupported(request: ImageRequest, serves_adapters: bool = False) -> None:
    """Refuse what OpenAI's API offers and this server cannot do, naming the field.
    `serves_adapters`: a stage applies LoRA adapters, so `model` may name one."""
    if request.response_format == "url":
        raise errors.InvalidArgument.field(
            "response_format", "'url' is not supported: images are returned inline; allowed: 'b64_json' (the default)"
        )
    if request.background == "transparent":
        raise errors.InvalidArgument.field(
            "background", "'transparent' is not supported: the pipeline draws opaque images; allowed: 'auto', 'opaque'"
        )
    if request.model not in (None, MODEL_ID) and not serves_adapters:
        raise errors.InvalidArgument.field(
            "model", f"unknown model {request.model!r}; allowed: {MODEL_ID!r} (GET /v1/models), or leave it out"
        )
    if request.model not in (None, MODEL_ID) and request.adapters:
        raise errors.InvalidArgument.field(
            "model",
            f"names adapter {request.model!r} while `adapters` is given; allowed with `adapters`: "
            f"{MODEL_ID!r} or leave it out (list the adapter in `adapters`)",
        )


def _adapters(request: ImageRequest) -> list[generation_pb2.AdapterChoice]:
    """`model` naming an adapter selects it at scale 1; `adapters` gives several with scales."""
    if request.model not in (None, MODEL_ID):
        return [generation_pb2.AdapterChoice(name=request.model, scale=1.0)]
    return [generation_pb2.AdapterChoice(name=a.name, scale=a.scale) for a in request.adapters or ()]


def to_generation_params(
    request: ImageRequest, init_image: bytes = b"", serves_adapters: bool = False
) -> generation_pb2.GenerationParams:
    """The proto the gRPC API takes; unset fields stay unset (the pipeline's defaults)."""
    check_unsupported(request, serves_adapters)
    params = generation_pb2.GenerationParams(
        prompt=request.prompt,
        output_format=converters.output_format_to_proto(request.output_format or formats.DEFAULT.name),
        init_image=init_image,
        adapters=_adapters(request),
    )
    size = parse_size(request.size)
    if size is not None:
        params.width, params.height = size
    if request.n is not None:
        params.num_images = request.n
    # JPEG and WebP only; 0 (OpenAI's most compressed) is the encoders' lowest quality, 1.
    if request.output_compression is not None and request.output_format in formats.LOSSY_NAMES:
        params.quality = max(1, request.output_compression)
    for name in ("seed", "negative_prompt", "num_inference_steps", "guidance_scale", "strength"):
        value = getattr(request, name)
        if value is not None:
            setattr(params, name, value)
    return params


def image_bytes(result: generation_pb2.GenerationResult) -> bytes:
    which = result.WhichOneof("image")
    if which not in formats.ENCODED_NAMES:
        raise errors.StagemeshError(f"the pipeline returned no encoded image (got {which})")
    return getattr(result, which)


def _b64(result: generation_pb2.GenerationResult) -> str:
    return base64.b64encode(image_bytes(result)).decode("ascii")


def images_response(results: list[generation_pb2.GenerationResult], output_format: str) -> dict[str, Any]:
    """OpenAI's ImagesResponse; each image also carries its `seed` (an extension)."""
    first = results[0]
    return {
        "created": int(time.time()),
        "data": [{"b64_json": _b64(r), "seed": r.seed} for r in results],
        "output_format": output_format,
        "size": f"{first.width}x{first.height}",
        "background": "opaque",
    }


# Stream events: OpenAI's `<prefix>.completed` per image, and progress as extensions
# (`<prefix>.stage_started`, `<prefix>.progress`); prefix is image_generation or image_edit.
def stage_started_event(prefix: str, stage_id: int, kind: str) -> dict[str, Any]:
    return {"type": f"{prefix}.stage_started", "created_at": int(time.time()), "stage_id": stage_id, "kind": kind}


def progress_event(prefix: str, stage_id: int, step: int, total: int, index: int) -> dict[str, Any]:
    return {
        "type": f"{prefix}.progress",
        "created_at": int(time.time()),
        "stage_id": stage_id,
        "step": step,
        "total": total,
        "index": index,
    }


def completed_event(prefix: str, result: generation_pb2.GenerationResult, output_format: str) -> dict[str, Any]:
    return {
        "type": f"{prefix}.completed",
        "created_at": int(time.time()),
        "b64_json": _b64(result),
        "output_format": output_format,
        "size": f"{result.width}x{result.height}",
        "quality": "auto",
        "background": "opaque",
        "usage": {
            "input_tokens": 0,
            "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
            "output_tokens": 0,
            "total_tokens": 0,
        },
        "index": result.index,
        "seed": result.seed,
    }


def _name(enum, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix)


def control_response(status: int, acks: list[control_pb2.WorkerAck], reason: str = "") -> dict[str, Any]:
    """A Sleep or WakeUp answer: as the gRPC one, with enum names instead of numbers."""
    return {
        "status": _name(control_pb2.ControlStatus, status, "CONTROL_STATUS_"),
        "reason": reason,
        "acks": [
            {
                "stage_id": a.stage_id,
                "rank": a.rank,
                "status": _name(control_pb2.AckStatus, a.status, "ACK_STATUS_"),
                "level": a.level,
                "freed_bytes": a.freed_bytes,
                "latency_ms": a.latency_ms,
                "error": a.error,
            }
            for a in acks
        ],
    }

"""OpenAI's Videos API shapes (POST /v1/videos' fields, the Video object) and their converters to
and from GenerationParams and the gateway's video jobs.

`seconds` becomes seconds x fps + 1 frames (Wan's 81 frames are 5 s at 16 fps); `num_frames`, as
an extension, names the count itself. Beyond OpenAI's fields the generation knobs are accepted:
num_frames, fps, seed, negative_prompt, num_inference_steps, guidance_scale. Any other field is
refused, as OpenAI does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stagemesh.core import errors
from stagemesh.gateway.http.openai_schema import MAX_SEED, MODEL_ID, parse_size
from stagemesh.gateway.video_jobs import VideoJob, VideoJobs
from stagemesh.v1 import generation_pb2


class VideoRequest(BaseModel):
    """POST /v1/videos, as JSON or as a multipart form (whose fields arrive as text)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    model: str | None = None
    seconds: float | None = Field(default=None, gt=0)
    size: str | None = None  # "WIDTHxHEIGHT"
    # Extensions: GenerationParams' own knobs.
    num_frames: int | None = Field(default=None, ge=1)
    fps: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None


def to_generation_params(request: VideoRequest, fps: int, start_image: bytes = b"") -> generation_pb2.GenerationParams:
    """The proto the gRPC API takes (MP4 out); `fps` is the pipeline's default, used to turn
    `seconds` into frames when the request names no fps."""
    if request.model not in (None, MODEL_ID):
        raise errors.InvalidArgument.field("model", f"{request.model!r} is not served here; allowed: {MODEL_ID!r}")
    if request.seconds is not None and request.num_frames is not None:
        raise errors.InvalidArgument.field(
            "seconds", "given with num_frames, which names the length itself; allowed: one of the two"
        )
    params = generation_pb2.GenerationParams(
        prompt=request.prompt, output_format=generation_pb2.OUTPUT_FORMAT_MP4, init_image=start_image
    )
    size = parse_size(request.size)
    if size is not None:
        params.width, params.height = size
    if request.seconds is not None:
        params.num_frames = round(request.seconds * (request.fps or fps)) + 1
    for name in ("num_frames", "fps", "seed", "negative_prompt", "num_inference_steps", "guidance_scale"):
        value = getattr(request, name)
        if value is not None:
            setattr(params, name, value)
    return params


def video_object(job: VideoJob, jobs: VideoJobs) -> dict[str, Any]:
    """OpenAI's Video object for a job."""
    p = job.params
    body: dict[str, Any] = {
        "id": job.id,
        "object": "video",
        "created_at": int(job.created_at),
        "completed_at": int(job.finished_at) if job.status == "completed" and job.finished_at else None,
        "expires_at": None if jobs.expires_at(job) is None else int(jobs.expires_at(job) or 0),
        "status": job.status,
        "progress": job.progress,
        "model": MODEL_ID,
        "prompt": p.prompt,
        "seconds": f"{p.num_frames / p.fps:g}" if p.fps else "0",
        "size": f"{p.width}x{p.height}",
        "remixed_from_video_id": None,
        "error": None,
        # Extensions: what the frames are.
        "num_frames": p.num_frames,
        "fps": p.fps,
        "seed": p.seed,
    }
    if job.error is not None:
        body["error"] = {"code": errors.status_name(job.error).lower(), "message": str(job.error)}
    return body

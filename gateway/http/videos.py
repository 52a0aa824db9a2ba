"""OpenAI's Videos API over the gateway's video jobs: POST /v1/videos (JSON, or a multipart form
with an `input_reference` start image) starts a job and answers its Video object; GET
/v1/videos/{id} reports status and progress; GET /v1/videos/{id}/content is the MP4; DELETE
cancels and forgets it; GET /v1/videos lists the jobs held. docs/API.md, "Video jobs"."""

from __future__ import annotations

import dataclasses

import pydantic
from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from stagemesh.core import errors, logs
from stagemesh.gateway.http import errors as http_errors
from stagemesh.gateway.http import video_schema as schema
from stagemesh.gateway.pipeline import Pipeline
from stagemesh.gateway.video_jobs import COMPLETED, VideoJobs

START_IMAGE_FIELD = "input_reference"


def add_routes(app: FastAPI, pipeline: Pipeline, jobs: VideoJobs, data: Depends) -> None:
    @app.post("/v1/videos", dependencies=[data])
    async def create(request: Request) -> JSONResponse:
        limits = pipeline.limits
        if not limits.video:
            raise errors.InvalidArgument.field(
                "model", "this mesh serves an image model, which draws no video; use POST /v1/images/generations"
            )
        body, start_image = await _read(request)
        wire = schema.to_generation_params(body, limits.default_fps, start_image)
        try:
            params = pipeline.resolve(wire)
        except errors.InvalidArgument as exc:
            raise errors.InvalidArgument([_http_field(v) for v in exc.violations]) from None
        job = jobs.create(params, logs.current_request_id())
        return JSONResponse(schema.video_object(job, jobs))

    @app.get("/v1/videos", dependencies=[data])
    async def listing() -> dict:
        data = [schema.video_object(job, jobs) for job in jobs.list()]
        return {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    @app.get("/v1/videos/{video_id}", dependencies=[data])
    async def retrieve(video_id: str) -> dict:
        return schema.video_object(jobs.get(video_id), jobs)

    @app.get("/v1/videos/{video_id}/content", dependencies=[data])
    async def content(video_id: str, variant: str = "video") -> Response:
        job = jobs.get(video_id)
        if variant != "video":
            raise errors.InvalidArgument.field("variant", f"{variant!r} is not served; allowed: 'video' (the MP4)")
        if job.status != COMPLETED or job.result is None:
            raise errors.FailedPrecondition(
                f"video job {video_id} is {job.status}, not completed; poll GET /v1/videos/{video_id} until it is"
            )
        return Response(job.result.mp4, media_type="video/mp4")

    @app.delete("/v1/videos/{video_id}", dependencies=[data])
    async def delete(video_id: str) -> dict:
        job = await jobs.delete(video_id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}


def _http_field(violation: errors.FieldViolation) -> errors.FieldViolation:
    if violation.field == "params.init_image":
        return dataclasses.replace(violation, field=START_IMAGE_FIELD)
    return violation


async def _read(request: Request) -> tuple[schema.VideoRequest, bytes]:
    """The request's fields and start image: a JSON body, or a multipart form (the openai SDK's
    way) whose `input_reference` file is the start image."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form()
        try:
            given = form.getlist(START_IMAGE_FIELD)
            files = [f for f in given if isinstance(f, UploadFile)]
            if len(given) > 1 or len(files) != len(given):
                raise errors.InvalidArgument.field(
                    START_IMAGE_FIELD, f"give at most one image file (PNG, JPEG or WebP); got {len(given)} fields"
                )
            fields = {k: v for k, v in form.multi_items() if k != START_IMAGE_FIELD and isinstance(v, str)}
            image = await files[0].read() if files else b""
            return _validated(fields), image
        finally:
            await form.close()
    try:
        fields = await request.json()
    except ValueError:
        raise errors.InvalidArgument.field("body", "not JSON; allowed: a JSON object or a multipart form") from None
    if not isinstance(fields, dict):
        raise errors.InvalidArgument.field("body", "allowed: a JSON object or a multipart form")
    if fields.get(START_IMAGE_FIELD) is not None:
        raise errors.InvalidArgument.field(
            START_IMAGE_FIELD, "a start image comes as a file of a multipart form; allowed in JSON: unset"
        )
    fields.pop(START_IMAGE_FIELD, None)
    return _validated(fields), b""


def _validated(fields: dict) -> schema.VideoRequest:
    try:
        return schema.VideoRequest.model_validate(fields)
    except pydantic.ValidationError as exc:
        raise errors.InvalidArgument(http_errors.validation_violations(exc.errors())) from None

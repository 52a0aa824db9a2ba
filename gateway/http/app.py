"""The gateway's HTTP routes: OpenAI's Images API, the mesh's state and the control calls, thin over
the same domain objects the gRPC servicer calls (Pipeline, ControlPlane), and the playground page
that drives them from a browser. docs/API.md, "HTTP API", lists them."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from dataclasses import dataclass

import pydantic
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from stagemesh.core import auth, errors, logs
from stagemesh.gateway.adapters import AdapterControl
from stagemesh.gateway.control import ControlPlane
from stagemesh.gateway.http import adapters as http_adapters
from stagemesh.gateway.http import errors as http_errors
from stagemesh.gateway.http import openai_schema as schema
from stagemesh.gateway.http import playground, videos
from stagemesh.gateway.http.generation import ClientGone, all_images, open_stream, unless_disconnected
from stagemesh.gateway.http.middleware import RequestContext
from stagemesh.gateway.pipeline import Pipeline
from stagemesh.gateway.settings import DEFAULT_MAX_VIDEO_JOBS, DEFAULT_VIDEO_JOB_TIMEOUT_S, DEFAULT_VIDEO_RETENTION_S
from stagemesh.gateway.video_jobs import VideoJobs
from stagemesh.v1 import gateway_pb2

CLIENT_CLOSED = 499  # the client went away before its answer (nginx's convention; never sent)
_SERVING = gateway_pb2.STAGE_STATE_SERVING
# Events go out as they happen: no caching, and no buffering in a proxy in front (nginx honours this).
_STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_STATE_NAMES = {v.number: v.name.removeprefix("STAGE_STATE_").lower() for v in gateway_pb2.StageState.DESCRIPTOR.values}


@dataclass(frozen=True)
class HttpSettings:
    max_request_bytes: int
    control_token: str | None = None  # the bearer token of the control routes; None: open
    api_key: str | None = None  # the bearer key of the data routes (the control token works too); None: open
    # Video jobs (/v1/videos): how many are held, how long one may run, how long a finished one is kept.
    max_video_jobs: int = DEFAULT_MAX_VIDEO_JOBS
    video_job_timeout_s: float = DEFAULT_VIDEO_JOB_TIMEOUT_S
    video_retention_s: float = DEFAULT_VIDEO_RETENTION_S


def create_app(
    pipeline: Pipeline, control: ControlPlane, settings: HttpSettings, adapters: AdapterControl | None = None
) -> FastAPI:
    """`app.state.stopping`: set by the listener when the gateway's stop grace has passed."""
    adapters = adapters if adapters is not None else AdapterControl(pipeline.stages)
    app = FastAPI(title="stagemesh", docs_url=None, redoc_url=None, openapi_url=None, **_without_own_spans())
    app.state.stopping = stopping = asyncio.Event()
    app.add_middleware(RequestContext, max_request_bytes=settings.max_request_bytes)
    _add_error_handlers(app)
    data = Depends(_api_key(settings.api_key, settings.control_token))
    ctl = Depends(_control_token(settings.control_token))
    started = int(time.time())

    @app.post("/v1/images/generations", dependencies=[data])
    async def generations(body: schema.GenerationRequest, request: Request) -> Response:
        return await _generate(pipeline, stopping, request, body, b"", "image_generation")

    @app.post("/v1/images/edits", dependencies=[data])
    async def edits(request: Request) -> Response:
        body, image = await _edit_form(request)
        return await _generate(pipeline, stopping, request, body, image, "image_edit")

    @app.get("/v1/models", dependencies=[data])
    async def models() -> dict:
        return await http_adapters.models(adapters, started)

    @app.get("/health")
    async def health() -> JSONResponse:
        stages = await pipeline.list_stages()
        serving = all(s.state == _SERVING for s in stages)
        body = {
            "status": "ok" if serving else "unavailable",
            "generation_paused": pipeline.admission.paused,
            "stages": [
                {"stage_id": s.stage_id, "kind": s.kind, "state": _STATE_NAMES[s.state], "sleep_level": s.sleep_level}
                for s in stages
            ],
        }
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/v1/omni/stages", dependencies=[data])
    async def stages() -> dict:
        """ListStages, and the request limits the pipeline sets (what a form may offer)."""
        return {
            "generation_paused": pipeline.admission.paused,
            "stages": [_stage_json(s) for s in await pipeline.list_stages()],
            "limits": dataclasses.asdict(pipeline.limits),
        }

    @app.post("/v1/omni/sleep", dependencies=[ctl])
    async def sleep(body: schema.SleepBody) -> dict:
        result = await control.sleep(body.stage_ids, body.level, None)
        return schema.control_response(result.status, result.acks, result.reason)

    @app.post("/v1/omni/wakeup", dependencies=[ctl])
    async def wakeup(body: schema.WakeUpBody) -> dict:
        result = await control.wake(body.stage_ids, None)
        return schema.control_response(result.status, result.acks, result.reason)

    @app.post("/v1/omni/pause", dependencies=[ctl])
    async def pause() -> dict:
        await control.pause()
        return {"status": "SUCCESS", "generation_paused": True}

    @app.post("/v1/omni/resume", dependencies=[ctl])
    async def resume() -> dict:
        control.resume()
        return {"status": "SUCCESS", "generation_paused": pipeline.admission.paused}

    http_adapters.add_routes(app, adapters, ctl)
    app.state.video_jobs = jobs = VideoJobs(
        pipeline, settings.max_video_jobs, settings.video_job_timeout_s, settings.video_retention_s
    )
    videos.add_routes(app, pipeline, jobs, data)
    playground.add_routes(app)
    return app


def _without_own_spans() -> dict:
    """FastAPI 0.16x makes a span of each request itself once a tracer provider is set; the
    gateway's middleware makes the request's span (middleware.py), which FastAPI's would double."""
    if "telemetry" in inspect.signature(FastAPI).parameters:
        return {"telemetry": {"tracing": False}}
    return {}


def _stage_json(stage: gateway_pb2.StageInfo) -> dict:
    return {
        "stage_id": stage.stage_id,
        "kind": stage.kind,
        "state": _STATE_NAMES[stage.state],
        "replicas": stage.replicas,
        "workers": stage.workers,
        "device": stage.device,
        "device_memory_bytes": stage.device_memory_bytes,
        "sleep_level": stage.sleep_level,
        "supports_sleep": stage.supports_sleep,
        "queue_depth": stage.queue_depth,
        "max_batch_size": stage.max_batch_size,
        "mean_batch_size": round(stage.mean_batch_size, 2),
    }


def _control_token(token: str | None):
    """A dependency refusing a request without `authorization: Bearer <token>`; open without a token."""

    async def check(request: Request) -> None:
        if token:
            auth.check_bearer(request.headers.items(), token)

    return check


def _api_key(api_key: str | None, token: str | None):
    """A dependency refusing a request without the API key (or the token as a bearer); open without a key."""

    async def check(request: Request) -> None:
        if api_key:
            auth.check_api_key(request.headers.items(), api_key, token)

    return check


async def _generate(
    pipeline: Pipeline,
    stopping: asyncio.Event,
    request: Request,
    body: schema.ImageRequest,
    image: bytes,
    prefix: str,
) -> Response:
    wire = schema.to_generation_params(body, image, pipeline.limits.supports_adapters)
    params = pipeline.resolve(wire)
    request_id = logs.current_request_id()
    output_format = params.output_format
    if body.stream:
        events = await open_stream(pipeline, request_id, params, stopping, prefix, output_format)
        return StreamingResponse(events, media_type="text/event-stream", headers=_STREAM_HEADERS)
    results = await unless_disconnected(request.receive, stopping, all_images(pipeline, request_id, params))
    return JSONResponse(schema.images_response(results, output_format))


async def _edit_form(request: Request) -> tuple[schema.EditRequest, bytes]:
    """The multipart form of /v1/images/edits: one `image` file, the other fields as text."""
    form = await request.form()
    try:
        images = form.getlist("image") + form.getlist("image[]")
        if form.get("mask") is not None:
            raise errors.InvalidArgument.field("mask", "masks are not supported: the whole image is redrawn")
        if len(images) != 1 or not isinstance(images[0], UploadFile):
            raise errors.InvalidArgument.field(
                "image", f"give exactly one image file (PNG, JPEG or WebP) as a form file field; got {len(images)}"
            )
        fields = {k: v for k, v in form.multi_items() if k not in ("image", "image[]") and isinstance(v, str)}
        try:
            body = schema.EditRequest.model_validate(fields)
        except pydantic.ValidationError as exc:
            raise errors.InvalidArgument(http_errors.validation_violations(exc.errors())) from None
        return body, await images[0].read()
    finally:
        await form.close()  # the uploaded file's spool


def _add_error_handlers(app: FastAPI) -> None:
    async def domain(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, errors.StagemeshError)
        return http_errors.error_response(*http_errors.from_domain(exc))

    async def validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return http_errors.error_response(*http_errors.invalid(http_errors.validation_violations(exc.errors())))

    async def http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        body = http_errors.error_body(exc.status_code, str(exc.detail))
        return http_errors.error_response(exc.status_code, body)

    async def gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    app.add_exception_handler(errors.StagemeshError, domain)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)
    app.add_exception_handler(ClientGone, gone)

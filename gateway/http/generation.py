"""Running a generation for an HTTP request: every image of it in one answer, or a server-sent
event stream; either way a client that goes away cancels the work in every stage, and so does the
gateway's stop once its grace has passed (`stopping` set): the request is then answered 503, or
its stream ends with an error event, rather than cut off mid-response."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar, cast

from starlette.types import Receive

from stagemesh.core import errors, logs, tracing
from stagemesh.core.params import Params
from stagemesh.gateway.http import errors as http_errors
from stagemesh.gateway.http import openai_schema as schema
from stagemesh.gateway.pipeline import DenoisingStep, Pipeline, StageStarted
from stagemesh.v1 import generation_pb2

log = logs.get_logger("stagemesh.gateway.http")

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before its answer was ready; the work was cancelled."""


def _stopped() -> errors.Unavailable:
    return errors.Unavailable("the gateway is stopping; the request was cancelled, retry it")


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (the body was read before: only http.disconnect is left)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, stopping: asyncio.Event, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled if the client disconnects first (ClientGone) or the gateway stops
    (Unavailable). uvicorn does not cancel a handler whose client has gone: the handler watches."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in (task, gone, stop):
            waiting.cancel()  # a no-op for the one that finished
        await asyncio.gather(task, gone, stop, return_exceptions=True)
    if task.cancelled():
        if stopping.is_set():
            raise _stopped()
        log.info("client went away; generation cancelled")
        raise ClientGone()
    return task.result()


async def all_images(pipeline: Pipeline, request_id: str, params: Params) -> list[generation_pb2.GenerationResult]:
    """Every GenerationResult of the request (one per image), in index order."""
    results = [
        event
        async for event in pipeline.generate(request_id, params, None)
        if isinstance(event, generation_pb2.GenerationResult)
    ]
    if not results:
        raise errors.StagemeshError("the pipeline ended without a result")
    return sorted(results, key=lambda r: r.index)


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


async def open_stream(
    pipeline: Pipeline, request_id: str, params: Params, stopping: asyncio.Event, prefix: str, output_format: str
) -> AsyncIterator[bytes]:
    """The event stream of one request. Its first event is taken here, before the response starts:
    a request refused at admission (paused, a stage asleep) gets its HTTP status, not a stream."""
    # Pipeline.generate is an async generator function; an error raised from it has closed it.
    events = cast(AsyncGenerator[object, None], pipeline.generate(request_id, params, None))
    first = await anext(events)
    return _stream(first, _until(events, stopping), prefix, output_format)


async def _until(events: AsyncGenerator[object, None], stopping: asyncio.Event) -> AsyncGenerator[object, None]:
    """`events` until they end, or until the gateway stops (Unavailable, after cancelling them)."""
    stop = asyncio.ensure_future(stopping.wait())
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(events))
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise _stopped()
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        # Stopping, or cancelled (the client went away): the pending step first, so that the
        # cancellation reaches the stage calls and `events` is no longer running when closed.
        stop.cancel()
        if step is not None and not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await events.aclose()


async def _stream(
    first: object, events: AsyncGenerator[object, None], prefix: str, output_format: str
) -> AsyncIterator[bytes]:
    # Starlette cancels this generator when the client disconnects; the cancellation reaches the
    # stage calls through the pipeline's own generator.
    try:
        yield _sse(_event(first, prefix, output_format))
        async for event in events:
            yield _sse(_event(event, prefix, output_format))
    except errors.StagemeshError as exc:
        # The status line has gone out: the error becomes the stream's last event, in OpenAI's shape.
        status, body = http_errors.from_domain(exc)
        if tracing.ON:
            tracing.fail_current(http_errors.error_text(status, body))
        yield _sse({"type": "error", **body})
    except Exception:
        log.exception("stream failed")
        status, body = http_errors.internal("the event stream")
        if tracing.ON:
            tracing.fail_current(http_errors.error_text(status, body))
        yield _sse({"type": "error", **body})
    finally:
        await events.aclose()


def _event(event: object, prefix: str, output_format: str) -> dict[str, Any]:
    if isinstance(event, StageStarted):
        return schema.stage_started_event(prefix, event.stage_id, event.kind)
    if isinstance(event, DenoisingStep):
        return schema.progress_event(prefix, event.stage_id, event.step, event.total, getattr(event, "index", 0))
    assert isinstance(event, generation_pb2.GenerationResult)
    return schema.completed_event(prefix, event, output_format)

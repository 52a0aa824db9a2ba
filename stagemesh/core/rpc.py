"""gRPC plumbing shared by every service: server set-up, request ids, and the one mapping
from domain errors to status codes (with google.rpc details)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from stagemesh.core import errors, logs, tracing
from stagemesh.core.params import MAX_REQUEST_ID_CHARS

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# gRPC's server pushback (gRFC A6): a retrying client waits this many milliseconds before its next attempt.
RETRY_PUSHBACK_HEADER = "grpc-retry-pushback-ms"

log = logs.get_logger("stagemesh.core.rpc")


def channel_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    # Results (raw tensors up to 1024x1024x3 float32) may be large; what is accepted is capped separately.
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_bytes),
    ]


def status_for(exc: errors.StagemeshError) -> tuple[grpc.StatusCode, str, tuple]:
    """The single mapping: a domain error becomes (code, message, trailing metadata).

    Field violations travel as google.rpc.BadRequest; the delay before a retry of UNAVAILABLE and
    RESOURCE_EXHAUSTED as google.rpc.RetryInfo, and also as `grpc-retry-pushback-ms`, which
    gRPC's own retry policy (stagemesh.Client's) waits for instead of its backoff.
    """
    if isinstance(exc, errors.UpstreamError):
        return exc.code, str(exc), exc.trailing_metadata
    code = grpc.StatusCode[errors.status_name(exc)]
    details: list[Message] = []
    pushback: tuple[tuple[str, str], ...] = ()
    if isinstance(exc, errors.InvalidArgument):
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                    for v in exc.violations
                ]
            )
        )
    delay_s = getattr(exc, "retry_delay_s", None)
    if delay_s is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromTimedelta(datetime.timedelta(seconds=delay_s))
        details.append(retry)
        pushback = ((RETRY_PUSHBACK_HEADER, str(round(delay_s * 1000))),)
    if not details:
        return code, str(exc), ()
    status = status_pb2.Status(code=code.value[0], message=str(exc), details=[_packed(d) for d in details])
    return code, str(exc), (*rpc_status.to_status(status).trailing_metadata, *pushback)


def _packed(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def request_id_of(context: grpc.aio.ServicerContext, explicit: str = "") -> str:
    """The request's id: the message's own field, else x-request-id metadata, else a new one."""
    if explicit:
        return explicit
    for key, value in context.invocation_metadata() or ():
        if key == logs.REQUEST_ID_HEADER and value:
            return str(value)
    return logs.new_request_id()


# How many requests of one request id the gateway sends a stage at once (the images of one
# Generate): a hint that lets the stage hold the first briefly so they share a batch.
IMAGES_HEADER = "x-stagemesh-images"
MAX_IMAGES_HINT = 1024


def outgoing_metadata(request_id: str, images: int = 1) -> tuple[tuple[str, str], ...]:
    if images > 1:
        return ((logs.REQUEST_ID_HEADER, request_id), (IMAGES_HEADER, str(images)))
    return ((logs.REQUEST_ID_HEADER, request_id),)


def images_hint(context: grpc.aio.ServicerContext) -> int:
    """The images count a caller announced (IMAGES_HEADER); 1 when absent or not a count from 1
    to MAX_IMAGES_HINT (a hint only: a wrong one costs at most a short wait)."""
    for key, value in context.invocation_metadata() or ():
        if key == IMAGES_HEADER:
            text = str(value)
            return int(text) if text.isdigit() and 1 <= int(text) <= MAX_IMAGES_HINT else 1
    return 1


def echoed_request_id(request_id: str) -> tuple[tuple[str, str], ...]:
    """The x-request-id a server sends back: empty for an id the method refuses (INVALID_ARGUMENT
    naming request_id): not a valid metadata value, or so long that echoing it would push the
    refusal's own headers past the client's metadata limit and turn it into RESOURCE_EXHAUSTED."""
    sendable = len(request_id) <= MAX_REQUEST_ID_CHARS and all(" " <= c <= "~" for c in request_id)
    return outgoing_metadata(request_id) if request_id and sendable else ()


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str, echo: tuple) -> None:
    if isinstance(exc, errors.StagemeshError):
        code, message, trailing = status_for(exc)
        log.info("rpc refused", method=method, code=code.name, reason=message)
    else:
        # Words only: an exception's class or text may name internals or other requests; the log has them.
        code, message, trailing = (
            grpc.StatusCode.INTERNAL,
            f"internal error in {method}; the service log has details",
            (),
        )
        log.exception("rpc failed", method=method)
    await context.abort(code, message, trailing_metadata=(*trailing, *echo))


def servicer_method(func: Callable) -> Callable:
    """Wraps a servicer method: binds the request id to logs, sends it back as x-request-id, and
    maps domain errors to status codes.

    The id goes out in the initial metadata with the first reply message, and in the trailing
    metadata of an error. Not before the first message: a client's gRPC retry policy retries
    UNAVAILABLE only while no response headers have arrived.

    Works for unary methods and for server-streaming (async generator) methods.
    """
    name = func.__name__

    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        async def stream_wrapper(self, request, context):
            request_id = request_id_of(context, getattr(request, "request_id", ""))
            echo = echoed_request_id(request_id)
            if tracing.ON:
                tracing.annotate_current(request_id=request_id)
            with logs.bound_request(request_id):
                started = time.perf_counter()
                try:
                    async for item in func(self, request, context):
                        if echo:
                            await context.send_initial_metadata(echo)
                            echo = ()
                        yield item
                    log.info("rpc done", method=name, ms=round((time.perf_counter() - started) * 1e3, 2))
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status, never a traceback
                    await _abort(context, exc, name, echoed_request_id(request_id))

        return stream_wrapper

    @functools.wraps(func)
    async def unary_wrapper(self, request, context):
        request_id = request_id_of(context, getattr(request, "request_id", ""))
        echo = echoed_request_id(request_id)
        if tracing.ON:
            tracing.annotate_current(request_id=request_id)
        with logs.bound_request(request_id):
            started = time.perf_counter()
            try:
                reply = await func(self, request, context)
                if echo:
                    await context.send_initial_metadata(echo)
                log.info("rpc done", method=name, ms=round((time.perf_counter() - started) * 1e3, 2))
                return reply
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never a traceback
                await _abort(context, exc, name, echo)

    return unary_wrapper


@dataclasses.dataclass(frozen=True)
class _Undecodable:
    """Stands in for a request message whose bytes do not parse."""

    reason: str


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError as exc:  # truncated bytes, a wrong wire type, a string field that is not UTF-8
            return _Undecodable(str(exc) or "the bytes are no such message")

    return parse


async def _refuse_undecodable(context, request: _Undecodable) -> None:
    log.info("rpc refused", code="INVALID_ARGUMENT", reason=f"request does not parse: {request.reason}")
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request message does not parse ({request.reason}); string fields must be UTF-8",
    )


def _checking_unary(behaviour: Callable) -> Callable:
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await _refuse_undecodable(context, request)
            async for reply in behaviour(request, context):
                yield reply

        return stream

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await _refuse_undecodable(context, request)
        reply = behaviour(request, context)
        return await reply if inspect.isawaitable(reply) else reply

    return unary


def _checking_stream(behaviour: Callable) -> Callable:
    async def checked(requests, context):
        async for request in requests:
            if isinstance(request, _Undecodable):
                await _refuse_undecodable(context, request)
            yield request

    if inspect.isasyncgenfunction(behaviour):

        async def stream(requests, context):
            async for reply in behaviour(checked(requests, context), context):
                yield reply

        return stream

    async def unary(requests, context):
        return await behaviour(checked(requests, context), context)

    return unary


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Bytes that are no request message get INVALID_ARGUMENT. grpc's own answer to a request
    deserializer that raises is UNKNOWN, which tells the caller nothing about whose fault it is."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        changes: dict[str, Any] = {"request_deserializer": _tolerant(handler.request_deserializer)}
        for kind, wrap in (
            ("unary_unary", _checking_unary),
            ("unary_stream", _checking_unary),
            ("stream_unary", _checking_stream),
            ("stream_stream", _checking_stream),
        ):
            if getattr(handler, kind) is not None:
                changes[kind] = wrap(getattr(handler, kind))
        return handler._replace(**changes)


# Overload is answered, never dropped in silence. gRPC's own bound on calls in handling answers
# RESOURCE_EXHAUSTED at once; without it, a burst past gRPC core's queue of calls not yet handed
# to the server (1000 by default) had some of them cancelled before any handler ran, CANCELLED
# and unlogged. Our bound comes first, so that queue never fills.
MAX_CONCURRENT_RPCS = 1024
_NO_SILENT_CANCELLATION = [
    ("grpc.server.max_pending_requests", 4 * MAX_CONCURRENT_RPCS),
    ("grpc.server.max_pending_requests_hard_limit", 8 * MAX_CONCURRENT_RPCS),
]


class ServiceHost:
    """A grpc.aio server with health (NOT_SERVING until marked ready) and reflection; with a
    `health_port`, a second, plaintext server answering grpc.health.v1 alone (the same statuses)
    for probes that cannot speak TLS."""

    def __init__(
        self,
        host: str,
        port: int,
        service_names: Iterable[str],
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
        *,
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None,
        health_port: int | None = None,
    ):
        # credentials: TLS for the port (stagemesh.core.tls); None serves plaintext.
        # Tracing outermost, so its spans also show what the others refuse; the decode check
        # innermost, so the others (metrics) see its refusals like any other status.
        interceptors = [*tracing.server_interceptors(), *interceptors, DecodeErrorInterceptor()]
        self.server = grpc.aio.server(
            options=[*channel_options(max_receive_bytes), *_NO_SILENT_CANCELLATION],
            interceptors=interceptors,
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        try:
            self.port = (
                self.server.add_secure_port(f"{host}:{port}", credentials)
                if credentials is not None
                else self.server.add_insecure_port(f"{host}:{port}")
            )
        except RuntimeError as exc:
            raise errors.Unavailable(f"cannot bind {host}:{port}: {exc}") from None
        self.address = f"{host}:{self.port}"
        self.health_server: grpc.aio.Server | None = None
        self.health_address = ""
        if health_port is not None:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            try:
                bound = self.health_server.add_insecure_port(f"{host}:{health_port}")
            except RuntimeError as exc:
                raise errors.Unavailable(f"cannot bind --health-port {host}:{health_port}: {exc}") from None
            self.health_address = f"{host}:{bound}"

    async def start(self) -> None:
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    async def stop(self, grace_s: float) -> None:
        """The calls in flight get `grace_s`; the health port answers NOT_SERVING until the end."""
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(None)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

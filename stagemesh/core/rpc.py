"""gRPC plumbing shared by every service: server set-up, request ids, and the one mapping
from domain errors to status codes (with google.rpc details)."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from stagemesh.core import errors, logs

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_STATUS_BY_ERROR: dict[type[errors.StagemeshError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}

log = logs.get_logger("stagemesh.core.rpc")


def channel_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    # Results (raw tensors up to 1024x1024x3 float32) may be large; what is accepted is capped separately.
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_bytes),
    ]


def status_for(exc: errors.StagemeshError) -> tuple[grpc.StatusCode, str, tuple]:
    """The single mapping: a domain error becomes (code, message, trailing metadata)."""
    if isinstance(exc, errors.UpstreamError):
        return exc.code, str(exc), exc.trailing_metadata
    code = next((c for t, c in _STATUS_BY_ERROR.items() if isinstance(exc, t)), grpc.StatusCode.INTERNAL)
    if isinstance(exc, errors.InvalidArgument):
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in exc.violations
            ]
        )
        detail = any_pb2.Any()
        detail.Pack(bad_request)
        status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(exc), details=[detail])
        return code, str(exc), tuple(rpc_status.to_status(status).trailing_metadata)
    return code, str(exc), ()


def request_id_of(context: grpc.aio.ServicerContext, explicit: str = "") -> str:
    """The request's id: the message's own field, else x-request-id metadata, else a new one."""
    if explicit:
        return explicit
    for key, value in context.invocation_metadata() or ():
        if key == logs.REQUEST_ID_HEADER and value:
            return str(value)
    return logs.new_request_id()


def outgoing_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((logs.REQUEST_ID_HEADER, request_id),)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
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
    await context.abort(code, message, trailing_metadata=trailing)


def servicer_method(func: Callable) -> Callable:
    """Wraps a servicer method: binds the request id to logs and maps domain errors to status codes.

    Works for unary methods and for server-streaming (async generator) methods.
    """
    name = func.__name__

    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        async def stream_wrapper(self, request, context):
            with logs.bound_request(request_id_of(context, getattr(request, "request_id", ""))):
                started = time.perf_counter()
                try:
                    async for item in func(self, request, context):
                        yield item
                    log.info("rpc done", method=name, ms=round((time.perf_counter() - started) * 1e3, 2))
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status, never a traceback
                    await _abort(context, exc, name)

        return stream_wrapper

    @functools.wraps(func)
    async def unary_wrapper(self, request, context):
        with logs.bound_request(request_id_of(context, getattr(request, "request_id", ""))):
            started = time.perf_counter()
            try:
                reply = await func(self, request, context)
                log.info("rpc done", method=name, ms=round((time.perf_counter() - started) * 1e3, 2))
                return reply
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                await _abort(context, exc, name)

    return unary_wrapper


class ServiceHost:
    """A grpc.aio server with health (NOT_SERVING until marked ready) and reflection."""

    def __init__(
        self,
        host: str,
        port: int,
        service_names: Iterable[str],
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
        *,
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None,
    ):
        # credentials: TLS for the port (stagemesh.core.tls); None serves plaintext.
        self.server = grpc.aio.server(options=channel_options(max_receive_bytes), interceptors=list(interceptors))
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

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

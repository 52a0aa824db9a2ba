"""What a failed call raises: one CallError subclass per status code that a caller may act on,
with the rich details the gateway sends (google.rpc.BadRequest, google.rpc.RetryInfo)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, cast

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from stagemesh.core import logs
from stagemesh.core.errors import FieldViolation, StagemeshError

__all__ = [
    "CallCancelledError",
    "CallError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FieldViolation",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "StagemeshError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "call_error",
    "raising_call_errors",
]


class CallError(StagemeshError):
    """A call the gateway refused or that could not be made.

    `code` is the gRPC status code, `details` its message, `field_violations` the bad fields of
    an INVALID_ARGUMENT (empty otherwise), `retry_delay` the seconds the server asks a caller to
    wait before trying again (None when it sent no google.rpc.RetryInfo), `request_id` the
    x-request-id the gateway answered with (None when the call never reached it).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        *,
        field_violations: Iterable[FieldViolation] = (),
        retry_delay: float | None = None,
        request_id: str | None = None,
    ):
        self.code = code
        self.details = details
        self.field_violations = list(field_violations)
        self.retry_delay = retry_delay
        self.request_id = request_id
        super().__init__(self.describe())

    def describe(self) -> str:
        """`CODE: details`, or `CODE:` and one indented `field: description` line per bad field."""
        if self.field_violations:
            return "\n".join([f"{self.code.name}:", *(f"  {v.field}: {v.description}" for v in self.field_violations)])
        return f"{self.code.name}: {self.details}"


class InvalidArgumentError(CallError):
    """A field out of range or a message that does not parse; `field_violations` names the fields."""


class FailedPreconditionError(CallError):
    """Generation is paused or a needed stage sleeps."""


class UnavailableError(CallError):
    """The gateway or a stage cannot be reached, or a worker died; retried by the client's policy first."""


class ResourceExhaustedError(CallError):
    """A full queue, undelivered results at the gateway's bound, or a message over a size limit."""


class DeadlineExceededError(CallError):
    """The call's deadline (its timeout) passed."""


class UnauthenticatedError(CallError):
    """A control call without the gateway's bearer token, or with another one."""


class PermissionDeniedError(CallError):
    pass


class NotFoundError(CallError):
    pass


class UnimplementedError(CallError):
    """The target cannot do this at all (a stage started without sleep support)."""


class CallCancelledError(CallError):
    """The call was cancelled (by this client, or by the server as it stopped)."""


class InternalError(CallError):
    """A bug in a service (INTERNAL), or a status gRPC could not map (UNKNOWN)."""


_BY_CODE: dict[grpc.StatusCode, type[CallError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.CANCELLED: CallCancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
}


def call_error(exc: grpc.RpcError) -> CallError:
    """The CallError for a failed call (a blocking call's grpc.RpcError or a grpc.aio.AioRpcError:
    both answer code(), details() and the metadata)."""
    call = cast(grpc.Call, exc)
    code = call.code()
    violations: list[FieldViolation] = []
    retry_delay = None
    for detail in _status_details(call):
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend(FieldViolation(v.field, v.description) for v in bad.field_violations)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry_delay = info.retry_delay.ToTimedelta().total_seconds()
    return _BY_CODE.get(code, CallError)(
        code,
        call.details() or "",
        field_violations=violations,
        retry_delay=retry_delay,
        request_id=request_id_of(call.trailing_metadata(), call.initial_metadata()),
    )


@contextlib.contextmanager
def raising_call_errors() -> Iterator[None]:
    """Inside: a failed gRPC call (blocking or aio) raises its CallError instead of grpc's error."""
    try:
        yield
    except grpc.RpcError as exc:
        raise call_error(exc) from None


def request_id_of(*metadata: Any) -> str | None:
    """The x-request-id in the first of these metadata that carries one."""
    for entries in metadata:
        for key, value in entries or ():
            if key == logs.REQUEST_ID_HEADER:
                return value if isinstance(value, str) else bytes(value).decode("ascii", "replace")
    return None


def _status_details(call: grpc.Call) -> list[Any]:
    try:
        status = rpc_status.from_call(call)
    except ValueError:  # a details trailer whose code disagrees with the call's: no details to trust
        return []
    return list(status.details) if status is not None else []

"""Domain errors. Domain modules raise these; each server maps them to gRPC status codes once."""

from __future__ import annotations

from dataclasses import dataclass


class StagemeshError(Exception):
    """Base of every error a service reports to its caller on purpose."""


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class InvalidArgument(StagemeshError):
    def __init__(self, violations: list[FieldViolation] | FieldViolation):
        if isinstance(violations, FieldViolation):
            violations = [violations]
        self.violations = list(violations)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))

    @classmethod
    def field(cls, field: str, description: str) -> InvalidArgument:
        return cls(FieldViolation(field, description))


class FailedPrecondition(StagemeshError):
    """The target is in a state that refuses the call (asleep, paused, loading)."""


# How long a caller should wait before trying again, sent as google.rpc.RetryInfo (docs/API.md).
# UNAVAILABLE: the gateway asks each stage a health check once a second (gateway.watch), so a stage
# that answers again is routed to within about a second, and a restarted worker takes seconds.
UNAVAILABLE_RETRY_DELAY_S = 1.0
# RESOURCE_EXHAUSTED (a full stage queue, results waiting for slow readers): room comes back as
# soon as a batch ends or a client reads, well under a second on the default model.
RESOURCE_EXHAUSTED_RETRY_DELAY_S = 0.25


class Unavailable(StagemeshError):
    """A stage, worker or peer cannot be reached or died."""

    retry_delay_s = UNAVAILABLE_RETRY_DELAY_S


class Unimplemented(StagemeshError):
    """The target cannot do this at all (e.g. a stage configured without sleep support)."""


class DeadlineExceeded(StagemeshError):
    pass


class ResourceExhausted(StagemeshError):
    """Admission refused: queue full or a size limit."""

    retry_delay_s = RESOURCE_EXHAUSTED_RETRY_DELAY_S


class Cancelled(StagemeshError):
    pass


class NotFound(StagemeshError):
    """What the request names does not exist (or no longer): an adapter the target does not
    hold, an expired video job."""


class UpstreamError(StagemeshError):
    """A status received from the next hop, passed on unchanged (code, message, details)."""

    def __init__(self, code, message: str, trailing_metadata=()):
        self.code = code
        self.trailing_metadata = tuple(trailing_metadata or ())
        super().__init__(message)


class Unauthenticated(StagemeshError):
    """A control call without the configured bearer token, or with a wrong one."""


# The gRPC status each domain error is answered with, by name: core.rpc maps errors to codes
# through it, and traces name a failure with it without importing gRPC.
_STATUS_NAMES: dict[type[StagemeshError], str] = {
    InvalidArgument: "INVALID_ARGUMENT",
    FailedPrecondition: "FAILED_PRECONDITION",
    Unavailable: "UNAVAILABLE",
    Unimplemented: "UNIMPLEMENTED",
    DeadlineExceeded: "DEADLINE_EXCEEDED",
    ResourceExhausted: "RESOURCE_EXHAUSTED",
    Cancelled: "CANCELLED",
    Unauthenticated: "UNAUTHENTICATED",
    NotFound: "NOT_FOUND",
}


def status_name(exc: StagemeshError) -> str:
    """The name of the gRPC status `exc` is answered with (INTERNAL for a plain StagemeshError)."""
    if isinstance(exc, UpstreamError):
        return str(exc.code.name)
    return next((name for kind, name in _STATUS_NAMES.items() if isinstance(exc, kind)), "INTERNAL")

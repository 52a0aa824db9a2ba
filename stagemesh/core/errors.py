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


class Unavailable(StagemeshError):
    """A stage, worker or peer cannot be reached or died."""


class Unimplemented(StagemeshError):
    """The target cannot do this at all (e.g. a stage configured without sleep support)."""


class DeadlineExceeded(StagemeshError):
    pass


class ResourceExhausted(StagemeshError):
    """Admission refused: queue full or a size limit."""


class Cancelled(StagemeshError):
    pass


class UpstreamError(StagemeshError):
    """A status received from the next hop, passed on unchanged (code, message, details)."""

    def __init__(self, code, message: str, trailing_metadata=()):
        self.code = code
        self.trailing_metadata = tuple(trailing_metadata or ())
        super().__init__(message)


class Unauthenticated(StagemeshError):
    """A control call without the configured bearer token, or with a wrong one."""

"""The Python client of a stagemesh gateway: Client (blocking) and AsyncClient (asyncio), the
typed results their calls return, and the errors they raise. docs/API.md, "Python client"."""

from stagemesh.client.aio import AsyncClient
from stagemesh.client.channel import RetryPolicy
from stagemesh.client.errors import (
    CallCancelledError,
    CallError,
    DeadlineExceededError,
    FailedPreconditionError,
    FieldViolation,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StagemeshError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from stagemesh.client.requests import GenerateOptions, VideoOptions
from stagemesh.client.results import (
    ControlResult,
    ControlStatus,
    GenerationResult,
    ProgressEvent,
    StageInfo,
    StageListing,
    StageState,
)
from stagemesh.client.sync import Client
from stagemesh.core.acks import WorkerAck
from stagemesh.core.events import DenoisingStep, StageStarted

__all__ = [
    "AsyncClient",
    "CallCancelledError",
    "CallError",
    "Client",
    "ControlResult",
    "ControlStatus",
    "DeadlineExceededError",
    "DenoisingStep",
    "FailedPreconditionError",
    "FieldViolation",
    "GenerateOptions",
    "GenerationResult",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "ProgressEvent",
    "ResourceExhaustedError",
    "RetryPolicy",
    "StageInfo",
    "StageListing",
    "StageStarted",
    "StageState",
    "StagemeshError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "VideoOptions",
    "WorkerAck",
]

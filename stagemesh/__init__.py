"""stagemesh: a gRPC mesh serving multi-stage generative models, and its Python client.

`from stagemesh import Client, AsyncClient` (docs/API.md, "Python client"). The client's names
load on first use, so that importing stagemesh (as `stagemesh --version` and the CLI do) stays
light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagemesh.client import (
        AsyncClient,
        CallCancelledError,
        CallError,
        Client,
        ControlResult,
        ControlStatus,
        DeadlineExceededError,
        DenoisingStep,
        FailedPreconditionError,
        FieldViolation,
        GenerateOptions,
        GenerationResult,
        InternalError,
        InvalidArgumentError,
        NotFoundError,
        PermissionDeniedError,
        ProgressEvent,
        ResourceExhaustedError,
        RetryPolicy,
        StageInfo,
        StageListing,
        StagemeshError,
        StageStarted,
        StageState,
        UnauthenticatedError,
        UnavailableError,
        UnimplementedError,
        VideoOptions,
        WorkerAck,
    )

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


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'stagemesh' has no attribute {name!r}")
    value = getattr(importlib.import_module("stagemesh.client"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

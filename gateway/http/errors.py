"""Errors of the HTTP API: OpenAI's error object, with the HTTP status taken from the same gRPC
status the gRPC API would answer (stagemesh.core.rpc.status_for, the one mapping of domain errors).

    {"error": {"message": "...", "type": "invalid_request_error", "param": "size", "code": "invalid_argument"}}

`code` is the gRPC status name in lower case; `param` names the request field at fault (the
HTTP name: `size` for a bad width, `n` for num_images), or is null.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from fastapi.responses import JSONResponse
from google.rpc import error_details_pb2, status_pb2

from stagemesh.core import errors, rpc, tracing
from stagemesh.gateway.http.openai_schema import http_param

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    # The target's state refuses the call (paused, a stage asleep): a conflict with the
    # server's state that a later call may not meet, not a malformed request.
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
REQUEST_TOO_LARGE = 413
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


def error_type(status: int) -> str:
    """OpenAI's `type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(status: int, body: dict[str, Any]) -> JSONResponse:
    if tracing.ON:  # the request's span says why it failed, as a gRPC call's does
        tracing.fail_current(error_text(status, body))
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def error_text(status: int, body: dict[str, Any]) -> str:
    """`CODE: message` of an error body (the gRPC status name where there is one)."""
    error = body["error"]
    return f"{(error.get('code') or f'HTTP {status}').upper()}: {error['message']}"


def invalid(violations: Sequence[errors.FieldViolation]) -> tuple[int, dict[str, Any]]:
    """400 naming every bad field in the message and the first one in `param`."""
    message = "; ".join(f"{http_param(v.field)}: {v.description}" for v in violations)
    return 400, error_body(400, message, http_param(violations[0].field), "invalid_argument")


def from_domain(exc: errors.StagemeshError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and error body of a domain error."""
    code, message, trailing = rpc.status_for(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        violations = exc.violations if isinstance(exc, errors.InvalidArgument) else _upstream_violations(trailing)
        if violations:
            return invalid(violations)
    status = HTTP_STATUS.get(code, 500)
    return status, error_body(status, message, None, code.name.lower())


def internal(what: str) -> tuple[int, dict[str, Any]]:
    # Words only, as the gRPC API answers: an exception's text may name internals; the log has them.
    return 500, error_body(500, f"internal error in {what}; the gateway log has details", None, "internal")


def _upstream_violations(trailing: Sequence[tuple[str, Any]]) -> list[errors.FieldViolation]:
    """The google.rpc.BadRequest a stage attached to its INVALID_ARGUMENT, if any."""
    for key, value in trailing:
        if key != _STATUS_DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                return [errors.FieldViolation(v.field, v.description) for v in bad.field_violations]
    return []


_SOURCES = ("body", "query", "path", "header")
EXTENSIONS = ("seed", "negative_prompt", "num_inference_steps", "guidance_scale", "strength")


def validation_violations(problems: Sequence[Any]) -> list[errors.FieldViolation]:
    """Pydantic's (and FastAPI's) validation errors as field violations named like the request's fields."""
    out = []
    for problem in problems:
        loc = [str(part) for part in problem.get("loc", ())]
        if loc and loc[0] in _SOURCES:
            loc = loc[1:]
        kind = problem.get("type", "")
        if kind == "json_invalid":
            out.append(errors.FieldViolation("body", f"is not valid JSON ({problem.get('ctx', {}).get('error', '')})"))
            continue
        field = ".".join(loc) or "body"
        if kind == "extra_forbidden":
            description = "unknown field; allowed: OpenAI's fields of this request and the extensions " + ", ".join(
                EXTENSIONS
            )
        elif kind == "missing":
            description = "is required"
        elif kind == "model_attributes_type" or (field == "body" and kind.endswith("_type")):
            description = "the body must be a JSON object, sent with content-type: application/json"
        else:
            description = f"{problem.get('msg', 'is not valid')} (got {_short(problem.get('input'))})"
        out.append(errors.FieldViolation(field, description))
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

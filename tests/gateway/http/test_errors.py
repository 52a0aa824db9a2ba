"""Domain errors -> HTTP status and OpenAI's error object, from the same gRPC status table."""

from __future__ import annotations

import grpc
import pydantic
import pytest

from stagemesh.core import errors, rpc
from stagemesh.gateway.http import errors as http_errors
from stagemesh.gateway.http import openai_schema as schema


@pytest.mark.parametrize(
    "exc, status, kind",
    [
        (errors.InvalidArgument.field("params.width", "too wide"), 400, "invalid_request_error"),
        (errors.Unauthenticated("missing bearer token"), 401, "authentication_error"),
        (errors.UpstreamError(grpc.StatusCode.PERMISSION_DENIED, "no"), 403, "permission_error"),
        (errors.UpstreamError(grpc.StatusCode.NOT_FOUND, "none"), 404, "invalid_request_error"),
        (errors.FailedPrecondition("generation is paused"), 409, "invalid_request_error"),
        (errors.ResourceExhausted("queue full"), 429, "rate_limit_error"),
        (errors.Unimplemented("stage 0 cannot sleep"), 501, "server_error"),
        (errors.Unavailable("stage 1 is unavailable"), 503, "server_error"),
        (errors.DeadlineExceeded("deadline passed"), 504, "server_error"),
        (errors.Cancelled("stage 1: cancelled"), 500, "server_error"),
        (errors.StagemeshError("no image"), 500, "server_error"),
    ],
)
def test_status_comes_from_the_grpc_code(exc, status, kind):
    got, body = http_errors.from_domain(exc)
    assert got == status
    assert body["error"]["type"] == kind
    assert body["error"]["code"] == rpc.status_for(exc)[0].name.lower()


def test_invalid_argument_names_every_field_by_its_http_name():
    exc = errors.InvalidArgument(
        [
            errors.FieldViolation("params.height", "17 is not a multiple of 16"),
            errors.FieldViolation("params.num_images", "above 4"),
        ]
    )
    status, body = http_errors.from_domain(exc)
    assert status == 400
    assert body["error"]["param"] == "size"
    assert body["error"]["message"] == "size: 17 is not a multiple of 16; n: above 4"


def test_a_stage_s_bad_request_details_name_the_field_too():
    # What the gateway passes on when a stage refuses a field (its google.rpc.BadRequest trailer).
    _, message, trailing = rpc.status_for(errors.InvalidArgument.field("params.strength", "above 1"))
    upstream = errors.UpstreamError(grpc.StatusCode.INVALID_ARGUMENT, message, trailing)
    status, body = http_errors.from_domain(upstream)
    assert (status, body["error"]["param"]) == (400, "strength")


def test_pydantic_errors_become_violations_named_like_the_fields():
    try:
        schema.GenerationRequest.model_validate({"n": 0, "size": 5, "bogus": 1})
    except pydantic.ValidationError as exc:
        violations = http_errors.validation_violations(exc.errors())
    fields = {v.field: v.description for v in violations}
    assert set(fields) == {"prompt", "n", "size", "bogus"}
    assert fields["prompt"] == "is required"
    assert "greater than or equal to 1" in fields["n"] and "(got 0)" in fields["n"]
    assert "unknown field" in fields["bogus"] and "num_inference_steps" in fields["bogus"]
    fastapi_style = http_errors.validation_violations(
        [{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}]
    )
    assert fastapi_style == [errors.FieldViolation("body", "is not valid JSON (Expecting value)")]

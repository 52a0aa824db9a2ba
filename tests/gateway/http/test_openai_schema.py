"""OpenAI request fields -> GenerationParams, and results -> OpenAI's response shapes."""

from __future__ import annotations

import base64

import pytest

from stagemesh.core import errors
from stagemesh.gateway.http import openai_schema as schema
from stagemesh.v1 import control_pb2, generation_pb2


def _params(**fields) -> generation_pb2.GenerationParams:
    return schema.to_generation_params(schema.GenerationRequest(prompt="a lighthouse", **fields))


def test_unset_fields_stay_unset_so_the_pipeline_defaults_apply():
    params = _params()
    assert params.prompt == "a lighthouse" and params.output_format == generation_pb2.OUTPUT_FORMAT_PNG
    for name in ("width", "height", "num_inference_steps", "guidance_scale", "seed", "num_images", "quality"):
        assert not params.HasField(name), name
    assert not _params(size="auto").HasField("width")


def test_openai_fields_and_the_extensions_reach_the_params():
    params = _params(
        n=2,
        size="320x192",
        output_format="webp",
        output_compression=0,
        seed=2**64 - 1,
        negative_prompt="fog",
        num_inference_steps=3,
        guidance_scale=2.5,
        strength=0.5,
    )
    assert (params.width, params.height, params.num_images) == (320, 192, 2)
    assert params.output_format == generation_pb2.OUTPUT_FORMAT_WEBP
    assert params.quality == 1  # OpenAI's 0 (most compressed) is the encoder's lowest quality
    assert (params.seed, params.negative_prompt, params.num_inference_steps) == (2**64 - 1, "fog", 3)
    assert params.guidance_scale == 2.5 and params.strength == 0.5
    assert not _params(output_format="png", output_compression=50).HasField("quality")  # PNG has none
    edit = schema.to_generation_params(schema.EditRequest(prompt="p"), b"\x89PNG...")
    assert edit.init_image == b"\x89PNG..."


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (dict(size="256"), "size", "WIDTHxHEIGHT"),
        (dict(size="-16x16"), "size", "WIDTHxHEIGHT"),
        (dict(response_format="url"), "response_format", "b64_json"),
        (dict(background="transparent"), "background", "opaque"),
        (dict(model="gpt-image-1"), "model", "'stagemesh'"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(fields, param, words):
    with pytest.raises(errors.InvalidArgument) as info:
        _params(**fields)
    assert [v.field for v in info.value.violations] == [param]
    assert words in str(info.value)


def test_domain_field_names_become_the_request_s_names():
    assert [schema.http_param(f) for f in ("params.width", "params.height", "params.num_images")] == ["size"] * 2 + [
        "n"
    ]
    assert schema.http_param("params.quality") == "output_compression"
    assert schema.http_param("params.init_image") == "image"
    assert schema.http_param("params.num_inference_steps") == "num_inference_steps"
    assert schema.http_param("request_id") == "x-request-id"
    assert schema.http_param("stage_ids") == "stage_ids"


def _result(index: int, fmt: str = "png") -> generation_pb2.GenerationResult:
    result = generation_pb2.GenerationResult(width=32, height=16, seed=100 + index, index=index)
    setattr(result, fmt, f"{fmt}-{index}".encode())
    return result


def test_images_response_and_completed_events_carry_the_image_and_its_seed():
    body = schema.images_response([_result(0), _result(1)], "png")
    assert [base64.b64decode(d["b64_json"]) for d in body["data"]] == [b"png-0", b"png-1"]
    assert [d["seed"] for d in body["data"]] == [100, 101] and body["size"] == "32x16"
    event = schema.completed_event("image_edit", _result(1, "jpeg"), "jpeg")
    assert event["type"] == "image_edit.completed" and base64.b64decode(event["b64_json"]) == b"jpeg-1"
    assert (event["index"], event["seed"], event["output_format"]) == (1, 101, "jpeg")
    with pytest.raises(errors.StagemeshError, match="no encoded image"):
        schema.images_response([generation_pb2.GenerationResult()], "png")


def test_control_answers_name_their_statuses():
    ack = control_pb2.WorkerAck(stage_id=1, rank=0, status=control_pb2.ACK_STATUS_ERROR, level=2, error="died")
    body = schema.control_response(control_pb2.CONTROL_STATUS_ERROR, [ack], "")
    assert body["status"] == "ERROR"
    assert body["acks"] == [
        {"stage_id": 1, "rank": 0, "status": "ERROR", "level": 2, "freed_bytes": 0, "latency_ms": 0.0, "error": "died"}
    ]

"""The OpenAI Images API through a real mesh, with the official `openai` SDK as the client:
generations and edits decode to images of the size asked, errors surface as the SDK's typed
errors naming the field, the stream sends progress then the image, and the key is required."""

from __future__ import annotations

import base64
import io

import grpc
import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from stagemesh.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2
from tests.gateway.http.conftest import API_KEY, MAX_REQUEST_BYTES, TOKEN, bearer

pytestmark = pytest.mark.mesh

SMALL = {"seed": 7, "num_inference_steps": 2}


@pytest.fixture
def sdk(base_url) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _image(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def _grpc_png(mesh, **params) -> bytes:
    with mesh.channel() as channel:
        reply = gateway_pb2_grpc.GatewayServiceStub(channel).GenerateUnary(
            gateway_pb2.GenerateUnaryRequest(params=generation_pb2.GenerationParams(**params)),
            timeout=120,
            metadata=tuple(bearer(API_KEY).items()),
        )
    return reply.result.png


def test_up_prints_the_http_address_with_a_hint_that_sends_the_key(http_mesh):
    assert f"HTTP API (OpenAI-compatible) on http://{http_mesh.http_address}/v1" in http_mesh.banner
    assert "authorization: Bearer $(cat " in http_mesh.banner


def test_generate_gives_a_png_of_the_size_asked_and_the_same_image_as_grpc(sdk, http_mesh):
    reply = sdk.images.generate(prompt="a lighthouse", size="64x48", n=1, response_format="b64_json", extra_body=SMALL)
    assert len(reply.data) == 1 and reply.size == "64x48" and reply.output_format == "png"
    image = _image(reply.data[0].b64_json)
    assert image.format == "PNG" and image.size == (64, 48)
    assert reply.data[0].model_extra["seed"] == 7
    # The same domain objects as the gRPC API: the same request draws the same bytes.
    same = _grpc_png(http_mesh, prompt="a lighthouse", width=64, height=48, num_inference_steps=2, seed=7)
    assert base64.b64decode(reply.data[0].b64_json) == same


def test_edit_takes_a_png_and_gives_an_image_of_the_size_asked(sdk):
    start = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(start, format="PNG")
    reply = sdk.images.edit(
        image=("start.png", start.getvalue(), "image/png"),
        prompt="the same, at night",
        size="64x64",
        extra_body={**SMALL, "strength": 0.6},
    )
    image = _image(reply.data[0].b64_json)
    assert image.format == "PNG" and image.size == (64, 64)


@pytest.mark.parametrize(
    "call, param",
    [
        (dict(size="65x64"), "size"),
        (dict(size="large"), "size"),
        (dict(size="64x2048"), "size"),
        (dict(response_format="url"), "response_format"),
        (dict(model="dall-e-3"), "model"),
        (dict(output_format="gif"), "output_format"),
        (dict(extra_body={"n": 0}), "n"),
        (dict(extra_body={"num_inference_steps": 201}), "num_inference_steps"),
        (dict(extra_body={"guidance_scale": 0.5}), "guidance_scale"),
        (dict(extra_body={"steps": 3}), "steps"),
        (dict(prompt="x" * 300), "prompt"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_fields_are_bad_request_errors_naming_the_field(sdk, call, param):
    args = {"prompt": "a lighthouse", "size": "64x64", **call}
    with pytest.raises(openai.BadRequestError) as info:
        sdk.images.generate(**args)
    assert info.value.status_code == 400
    assert info.value.param == param, info.value.body
    assert info.value.code == "invalid_argument" and info.value.type == "invalid_request_error"


def test_a_mask_is_refused_naming_it(sdk):
    png = io.BytesIO()
    Image.new("RGB", (16, 16)).save(png, format="PNG")
    with pytest.raises(openai.BadRequestError) as info:
        sdk.images.edit(image=("a.png", png.getvalue(), "image/png"), mask=("m.png", png.getvalue()), prompt="x")
    assert info.value.param == "mask"


def test_the_stream_sends_stage_and_step_progress_then_the_image(sdk):
    events = list(
        sdk.images.generate(
            prompt="a lighthouse", size="32x32", stream=True, extra_body={"seed": 5, "num_inference_steps": 3}
        )
    )
    types = [e.type for e in events]
    assert types == [
        "image_generation.stage_started",
        "image_generation.stage_started",
        *["image_generation.progress"] * 3,
        "image_generation.completed",
    ], types
    steps = [(e.model_extra["step"], e.model_extra["total"]) for e in events if e.type.endswith(".progress")]
    assert steps == [(1, 3), (2, 3), (3, 3)]
    done = events[-1]
    assert done.size == "32x32" and done.output_format == "png" and done.model_extra["seed"] == 5
    unary = sdk.images.generate(prompt="a lighthouse", size="32x32", extra_body={"seed": 5, "num_inference_steps": 3})
    assert done.b64_json == unary.data[0].b64_json


def test_models_lists_the_one_pipeline(sdk):
    assert [m.id for m in sdk.models.list()] == ["stagemesh"]
    assert sdk.images.generate(prompt="a", size="16x16", model="stagemesh", extra_body=SMALL).data


def test_the_data_plane_needs_the_key_or_the_control_token(base_url):
    with pytest.raises(openai.AuthenticationError) as info:
        OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
    assert info.value.status_code == 401 and info.value.type == "authentication_error"
    bare = httpx.post(f"{base_url}/v1/images/generations", json={"prompt": "a"}, timeout=30)
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert bare.json()["error"]["message"].startswith("missing API key")
    # stagemesh.Client's header works here too.
    assert httpx.get(f"{base_url}/v1/models", headers={"x-api-key": API_KEY}, timeout=30).status_code == 200
    assert httpx.get(f"{base_url}/v1/models", headers=bearer(TOKEN), timeout=30).status_code == 200
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200  # health stays open


def test_the_grpc_data_plane_needs_the_key_too(http_mesh):
    params = generation_pb2.GenerationParams(prompt="a", width=16, height=16, num_inference_steps=1, seed=1)
    with http_mesh.channel() as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for call, request in (
            (stub.GenerateUnary, gateway_pb2.GenerateUnaryRequest(params=params)),
            (stub.ListStages, gateway_pb2.ListStagesRequest()),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=30, metadata=(("authorization", "Bearer wrong"),))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for metadata in (bearer(API_KEY), bearer(TOKEN), {"x-api-key": API_KEY}):
                call(request, timeout=60, metadata=tuple(metadata.items()))
        with pytest.raises(grpc.RpcError) as info:  # the key opens no control call
            stub.PauseGeneration(
                gateway_pb2.PauseGenerationRequest(), timeout=30, metadata=tuple(bearer(API_KEY).items())
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_request_id_comes_back_and_reaches_the_stages(client, http_mesh):
    reply = client.post(
        "/v1/images/generations",
        json={"prompt": "a", "size": "16x16", **SMALL},
        headers={"x-request-id": "http-id-0001"},
    )
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "http-id-0001"
    stage_lines = [line for line in http_mesh.logs().splitlines() if '"service": "stage-1"' in line]
    assert any('"request_id": "http-id-0001"' in line for line in stage_lines)
    generated = client.get("/v1/models")
    assert len(generated.headers["x-request-id"]) == 32  # one is made when none is given
    refused = client.get("/v1/models", headers={"x-request-id": "x" * 129})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "x-request-id"


def test_malformed_bodies_are_400_in_openai_shape(client):
    for body in (b"{not json", b"[1, 2]", b'{"size": "16x16"}'):
        reply = client.post("/v1/images/generations", content=body, headers={"content-type": "application/json"})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["type"] == "invalid_request_error", reply.text
        assert error["param"] in ("body", "prompt"), error


def test_a_body_over_max_request_bytes_is_413(client):
    big = {"prompt": "a", "negative_prompt": "x" * MAX_REQUEST_BYTES}
    reply = client.post("/v1/images/generations", json=big)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    # Without a content-length (chunked), the bound holds while the body is read.
    chunks = (b"x" * 65536 for _ in range(MAX_REQUEST_BYTES // 65536 + 2))
    reply = client.post("/v1/images/edits", content=chunks, headers={"content-type": "multipart/form-data; boundary=b"})
    assert reply.status_code == 413


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK's notice about OpenAI's own video API
def test_an_image_model_refuses_video_jobs_naming_the_model(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.videos.create(prompt="a lighthouse", size="64x64")
    assert info.value.param == "model" and "image model" in info.value.body["message"]

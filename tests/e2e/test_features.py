"""The request features through a real mesh (the session's: the embedded ar + diffusion stages,
max size 512, max steps 50): num_images, JPEG and WebP, image-to-image, the negative prompt, and
what the stages report and re-check themselves."""

from __future__ import annotations

import io

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from stagemesh.stage_service.transport import tensors
from stagemesh.v1 import control_pb2, gateway_pb2, generation_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2
from tests.e2e.test_api_errors import _bad_request

pytestmark = pytest.mark.mesh

TENSOR = generation_pb2.OUTPUT_FORMAT_TENSOR
TIMEOUT_S = 120.0


def _params(**kw) -> generation_pb2.GenerationParams:
    base = dict(prompt="a lighthouse at dusk", width=32, height=32, num_inference_steps=3, seed=41)
    base.update(kw)
    return generation_pb2.GenerationParams(**base)


def _unary(stub, **kw) -> gateway_pb2.GenerateUnaryResponse:
    return stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=_params(**kw)), timeout=TIMEOUT_S)


def _pixels(result: generation_pb2.GenerationResult) -> torch.Tensor:
    """float32 [H, W, 3] in [0, 1], from a TENSOR result or any encoded one."""
    if result.HasField("tensor"):
        return tensors.from_proto(result.tensor)
    data = getattr(result, result.WhichOneof("image"))
    with Image.open(io.BytesIO(data)) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).float() / 255


def _picture(size: int) -> bytes:
    """A PNG with structure (colour gradients and a bright disc)."""
    ys, xs = np.meshgrid(np.linspace(0, 1, size), np.linspace(0, 1, size), indexing="ij")
    disc = (((xs - 0.6) ** 2 + (ys - 0.4) ** 2) < 0.05).astype(float)
    pixels = (np.stack([xs, ys, disc], axis=-1) * 255).round().astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def stub(mesh):
    with mesh.channel() as channel:
        yield mesh.gateway(channel)


# ---- num_images ---------------------------------------------------------------------------------------
def test_num_images_draws_seed_plus_index_and_reports_each(stub):
    reply = _unary(stub, num_images=3, output_format=TENSOR)
    assert [(r.index, r.seed) for r in reply.results] == [(0, 41), (1, 42), (2, 43)]
    assert reply.result == reply.results[0]
    images = [_pixels(r) for r in reply.results]
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[1], images[2])
    for i, image in enumerate(images):
        alone = _pixels(_unary(stub, seed=41 + i, output_format=TENSOR).result)
        # The images of one request run batched together; with batch_invariant (the stage's
        # default) each is the bytes it would be alone.
        assert torch.equal(image, alone), (i, (image - alone).abs().max())


def test_num_images_streams_every_images_steps_and_results(stub):
    request = gateway_pb2.GenerateRequest(params=_params(num_images=2, num_inference_steps=2))
    events = list(stub.Generate(request, timeout=TIMEOUT_S))
    started = [e.stage_started.stage_id for e in events if e.HasField("stage_started")]
    assert started == [0, 1]  # once per stage, whatever the number of images
    steps = sorted(
        (e.denoising_step.index, e.denoising_step.step, e.denoising_step.total)
        for e in events
        if e.HasField("denoising_step")
    )
    assert steps == [(0, 1, 2), (0, 2, 2), (1, 1, 2), (1, 2, 2)]
    results = sorted((e.result for e in events if e.HasField("result")), key=lambda r: r.index)
    assert [(r.index, r.seed) for r in results] == [(0, 41), (1, 42)]
    assert events[-1].HasField("result") and all(r.png for r in results)


def test_seeds_wrap_around_the_uint64_range(stub):
    reply = _unary(stub, num_images=2, seed=2**64 - 1, num_inference_steps=1)
    assert [r.seed for r in reply.results] == [2**64 - 1, 0]


# ---- output formats ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "enum,field,pil",
    [(generation_pb2.OUTPUT_FORMAT_JPEG, "jpeg", "JPEG"), (generation_pb2.OUTPUT_FORMAT_WEBP, "webp", "WEBP")],
)
def test_jpeg_and_webp_results_decode_with_pillow_at_the_right_size(stub, enum, field, pil):
    size = dict(width=64, height=48)
    result = _unary(stub, output_format=enum, **size).result
    assert result.WhichOneof("image") == field and result.output_format == enum
    with Image.open(io.BytesIO(getattr(result, field))) as image:
        assert (image.format, image.size, image.mode) == (pil, (64, 48), "RGB")
    exact = _pixels(_unary(stub, output_format=TENSOR, **size).result)
    assert (_pixels(result) - exact).abs().mean() < 0.08  # lossy (chroma subsampled noise), close
    smaller = _unary(stub, output_format=enum, quality=5, **size).result
    assert len(getattr(smaller, field)) < len(getattr(result, field))  # default quality 90


# ---- image-to-image ----------------------------------------------------------------------------------
def test_image_to_image_stays_close_at_low_strength_and_ignores_the_image_at_strength_1(stub):
    picture = _picture(64)
    target = _pixels(generation_pb2.GenerationResult(png=picture))
    common = dict(init_image=picture, num_inference_steps=10, output_format=TENSOR, width=None, height=None)
    low = _unary(stub, strength=0.2, **common).result
    full = _unary(stub, strength=1.0, **common).result
    assert (low.width, low.height) == (64, 64)  # the size is the starting image's
    text_only = _unary(stub, num_inference_steps=10, output_format=TENSOR, width=64, height=64).result
    near, far = (_pixels(low) - target).abs().mean().item(), (_pixels(full) - target).abs().mean().item()
    assert near < far / 2, (near, far)
    assert torch.equal(_pixels(full), _pixels(text_only))  # strength 1 starts from pure noise
    assert torch.equal(_pixels(_unary(stub, strength=0.2, **common).result), _pixels(low))  # deterministic


def test_image_to_image_reports_the_steps_that_run(stub):
    params = _params(init_image=_picture(32), strength=0.5, num_inference_steps=4, width=None, height=None)
    events = list(stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=TIMEOUT_S))
    steps = [(e.denoising_step.step, e.denoising_step.total) for e in events if e.HasField("denoising_step")]
    assert steps == [(1, 2), (2, 2)]  # int(4 * 0.5): the last two steps of four


# ---- negative prompt ------------------------------------------------------------------------------------
def test_negative_prompt_changes_the_output(stub):
    plain = _pixels(_unary(stub, output_format=TENSOR).result)
    steered = _pixels(_unary(stub, output_format=TENSOR, negative_prompt="fog").result)
    other = _pixels(_unary(stub, output_format=TENSOR, negative_prompt="rain").result)
    assert not torch.equal(plain, steered) and not torch.equal(steered, other)


# ---- refusals through the real gateway --------------------------------------------------------------
BAD = [
    ("num-images-9", dict(num_images=9), "params.num_images", ["9", "1 to 8"]),
    ("quality-with-png", dict(quality=50), "params.quality", ["JPEG and WEBP only"]),
    ("quality-0", dict(quality=0, output_format=generation_pb2.OUTPUT_FORMAT_JPEG), "params.quality", ["1 to 100"]),
    ("strength-alone", dict(strength=0.5), "params.strength", ["without an init_image"]),
    ("negative-unguided", dict(negative_prompt="fog", guidance_scale=1.0), "params.negative_prompt", ["1.0"]),
    ("negative-too-long", dict(negative_prompt="x" * 300), "params.negative_prompt", ["300", "256"]),
    ("image-garbage", dict(init_image=b"not an image"), "params.init_image", ["PNG, JPEG or WebP"]),
    ("image-sides", dict(init_image=None, width=None, height=None), "params.init_image", ["40x40", "multiples of 16"]),
    ("image-size-given", dict(init_image=None, width=32, height=64), "params.width", ["init_image's width 64"]),
    (
        "image-strength-0",
        dict(init_image=None, strength=0.0, width=None, height=None),
        "params.strength",
        ["above 0 up to 1"],
    ),
]


@pytest.mark.parametrize("fields,field,needles", [pytest.param(f, v, n, id=i) for i, f, v, n in BAD])
def test_bad_new_fields_are_invalid_argument_naming_them(stub, fields, field, needles):
    if "init_image" in fields and fields["init_image"] is None:
        fields = dict(fields, init_image=_picture(40 if field == "params.init_image" else 64))
    with pytest.raises(grpc.RpcError) as info:
        _unary(stub, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    violations = {v.field: v.description for v in _bad_request(info.value).field_violations}
    assert set(violations) == {field}, violations
    for needle in needles:
        assert needle in violations[field], (needle, violations[field])


# ---- the stages: what they report, what they re-check ----------------------------------------------
@pytest.fixture(scope="module")
def stages(mesh):
    addresses = mesh.child_addresses()
    channels = [grpc.insecure_channel(addresses[f"stage-{i}"]) for i in (0, 1)]
    yield [stage_pb2_grpc.StageServiceStub(c) for c in channels]
    for c in channels:
        c.close()


def test_stages_describe_what_their_models_can_use(stages):
    ar, diffusion = (s.DescribeStage(stage_pb2.DescribeStageRequest(), timeout=10) for s in stages)
    assert (ar.supports_negative_prompt, ar.supports_init_image) == (True, False)
    assert (diffusion.supports_negative_prompt, diffusion.supports_init_image) == (True, True)


def _execute_violations(stub, params: generation_pb2.GenerationParams, inputs: dict) -> dict[str, str]:
    request = stage_pb2.ExecuteRequest(request_id="recheck", params=params, inputs=inputs)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Execute(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return {v.field: v.description for v in _bad_request(info.value).field_violations}


def test_a_stage_rechecks_what_its_caller_sends(stages):
    ar, diffusion = stages
    hidden = tensors.to_proto(torch.zeros(5, 64))
    image = tensors.to_proto(torch.zeros(32, 32, 3, dtype=torch.uint8))
    base = dict(prompt="p", width=32, height=32, num_inference_steps=2, seed=1)
    cases = [
        (diffusion, dict(base, strength=0.5), {"hidden_states": hidden}, "params.strength"),
        (diffusion, dict(base, num_images=2), {"hidden_states": hidden}, "params.num_images"),
        (diffusion, dict(base, init_image=_picture(32)), {"hidden_states": hidden}, "params.init_image"),
        (diffusion, dict(base, width=64), {"hidden_states": hidden, "init_image": image}, "params.width"),
        (
            diffusion,
            base,
            {"hidden_states": hidden, "init_image": tensors.to_proto(torch.zeros(32, 32, 3))},
            "inputs[init_image]",
        ),
        (ar, base, {"init_image": image}, "inputs[init_image]"),
    ]
    for stub, params, inputs, field in cases:
        violations = _execute_violations(stub, generation_pb2.GenerationParams(**params), inputs)
        assert set(violations) == {field}, (field, violations)
        assert "allowed" in violations[field] or "takes" in violations[field], violations


def test_a_stage_runs_an_image_to_image_request_sent_to_it_directly(stages):
    _, diffusion = stages
    image: tensor_pb2.Tensor = tensors.to_proto(torch.full((32, 32, 3), 200, dtype=torch.uint8))
    params = generation_pb2.GenerationParams(prompt="p", num_inference_steps=4, strength=0.5, seed=3)
    request = stage_pb2.ExecuteRequest(
        request_id="direct",
        params=params,
        inputs={"hidden_states": tensors.to_proto(torch.zeros(5, 64)), "init_image": image},
    )
    replies = list(diffusion.Execute(request, timeout=30))
    assert [(r.progress.step, r.progress.total) for r in replies if r.HasField("progress")] == [(1, 2), (2, 2)]
    drawn = tensors.from_proto(replies[-1].outputs.outputs["image"])
    assert drawn.shape == (32, 32, 3)  # the starting image's size: width and height were left unset


def test_an_image_for_an_encoded_format_leaves_the_stage_as_the_pixels_the_gateway_encodes(stages):
    """For PNG (JPEG, WebP) the stage sends uint8 pixels, a quarter of the float32 bytes, and the
    gateway's PNG of them is byte for byte the PNG of the float image a tensor request gets."""
    from stagemesh.gateway.images import encode_png

    _, diffusion = stages
    hidden = {"hidden_states": tensors.to_proto(torch.linspace(-1, 1, 5 * 64).reshape(5, 64))}
    drawn = {}
    for fmt in (generation_pb2.OUTPUT_FORMAT_PNG, generation_pb2.OUTPUT_FORMAT_TENSOR):
        params = generation_pb2.GenerationParams(
            prompt="p", width=32, height=32, num_inference_steps=2, seed=3, output_format=fmt
        )
        replies = list(diffusion.Execute(stage_pb2.ExecuteRequest(request_id="px", params=params, inputs=hidden)))
        drawn[fmt] = replies[-1].outputs.outputs["image"]
    pixels, floats = drawn[generation_pb2.OUTPUT_FORMAT_PNG], drawn[generation_pb2.OUTPUT_FORMAT_TENSOR]
    assert (pixels.dtype, floats.dtype) == ("uint8", "float32")
    assert len(pixels.data) * 4 == len(floats.data)
    as_png = encode_png(tensors.from_proto(pixels).numpy())
    assert as_png == encode_png(tensors.from_proto(floats).numpy())


# ---- one request, several images: nothing is left behind --------------------------------------------
def test_a_cancelled_request_of_several_images_leaves_admission_and_stages_free(sleepy):
    """Sleep waits until every admitted Generate has reached its first stage and every stage has
    finished what it runs: a ticket or an image left behind by the cancelled request would hold it."""
    params = _params(num_images=3, width=256, height=256, num_inference_steps=40)
    with sleepy.channel() as channel:
        stub = sleepy.gateway(channel)
        call = stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=TIMEOUT_S)
        with pytest.raises(grpc.RpcError) as info:
            for event in call:
                if event.HasField("denoising_step"):
                    call.cancel()
        assert info.value.code() == grpc.StatusCode.CANCELLED
        try:
            reply = stub.Sleep(gateway_pb2.SleepRequest(stage_ids=[0, 1], level=1), timeout=60)
            assert reply.status == control_pb2.CONTROL_STATUS_SUCCESS
        finally:
            stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[0, 1]), timeout=60)
            stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=60)
        after = stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=_params(num_images=2)), timeout=60)
    assert [r.index for r in after.results] == [0, 1]

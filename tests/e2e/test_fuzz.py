"""Random and malformed input through gRPC against a real mesh: Sleep, WakeUp and the Generate
fields test_api_errors.py's sweep leaves out (request_id, seed, unset fields, output_format, and
the request features: num_images, quality, negative_prompt, strength, init_image), then raw
bytes that are no protobuf message at all. Whatever arrives, no service answers
UNKNOWN or INTERNAL from its own code, none dies, and every refusal names its field.

Sleep mutates the mesh, so this module uses the one the sleep tests share (tests/e2e/conftest.py),
never the session's; each example that put a stage to sleep wakes it and resumes generation before
the next."""

from __future__ import annotations

import io
import math

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from stagemesh.v1 import cache_pb2, control_pb2, gateway_pb2, generation_pb2, stage_pb2
from tests.e2e.test_api_errors import _bad_request
from tests.support.meshproc import alive, descendants

pytestmark = pytest.mark.mesh

STAGES = (0, 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
TIMEOUT_S = 60.0
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


@pytest.fixture(scope="module")
def fuzz_mesh(sleepy):
    """The shared sleep mesh; its clean stop (exit 0, no traceback) is checked when the session ends."""
    mesh = sleepy
    pids = {mesh.process.pid, *descendants(mesh.process.pid)}
    yield mesh
    # Nothing died on the way (a restarted service or worker would have a new pid).
    assert {mesh.process.pid, *descendants(mesh.process.pid)} == pids, "a mesh process died or was restarted"
    assert all(alive(p) for p in pids)
    assert "Traceback" not in mesh.logs()


@pytest.fixture(scope="module")
def channel(fuzz_mesh):
    with fuzz_mesh.channel() as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(fuzz_mesh, channel):
    return fuzz_mesh.gateway(channel)


def violated_fields(err: grpc.RpcError) -> set[str]:
    assert err.code() not in NEVER, (err.code(), err.details())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    return {v.field for v in _bad_request(err).field_violations}


def restore(stub) -> None:
    stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=list(STAGES)), timeout=TIMEOUT_S)
    stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=TIMEOUT_S)


# Half the lists hold only real ids (duplicates included), half mix in any int32.
_stage_ids = st.one_of(
    st.lists(st.sampled_from(STAGES), max_size=4),
    st.lists(st.one_of(st.sampled_from(STAGES), INT32), min_size=1, max_size=6),
)


@FUZZ
@given(stage_ids=_stage_ids, level=st.one_of(st.none(), st.sampled_from([1, 2]), INT32))
def test_sleep_with_any_ids_and_level_sleeps_or_names_the_bad_field(stub, stage_ids, level):
    expected = ({"stage_ids"} if not stage_ids or set(stage_ids) - set(STAGES) else set()) | (
        {"level"} if level is not None and level not in (1, 2) else set()
    )
    request = gateway_pb2.SleepRequest(stage_ids=stage_ids, level=level)
    try:
        reply = stub.Sleep(request, timeout=TIMEOUT_S)
    except grpc.RpcError as err:
        assert violated_fields(err) == expected, (request, err.details())
        event(f"refused: {sorted(expected)}")
        return
    finally:
        restore(stub)
    event(f"slept {len(set(stage_ids))} stage(s)")
    assert not expected, f"accepted although {expected} are bad: {request}"
    assert reply.status == control_pb2.CONTROL_STATUS_SUCCESS
    # One ACK per worker (one each here) of every distinct stage, at the level asked for.
    assert sorted(a.stage_id for a in reply.acks) == sorted(set(stage_ids))
    assert {a.level for a in reply.acks} <= {level or 2}


@FUZZ
@given(asleep=st.lists(st.sampled_from(STAGES), unique=True), stage_ids=_stage_ids)
def test_wakeup_with_any_ids_wakes_what_sleeps_or_names_the_bad_field(stub, asleep, stage_ids):
    try:
        if asleep:
            stub.Sleep(gateway_pb2.SleepRequest(stage_ids=asleep, level=1), timeout=TIMEOUT_S)
        try:
            reply = stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=stage_ids), timeout=TIMEOUT_S)
        except grpc.RpcError as err:
            assert not stage_ids or set(stage_ids) - set(STAGES), err.details()
            assert violated_fields(err) == {"stage_ids"}
            return
        woken = set(asleep) & set(stage_ids)
        event(f"woke {len(woken)} of {len(asleep)} asleep")
        assert not set(stage_ids) - set(STAGES), f"accepted unknown ids: {stage_ids}"
        if woken:
            assert reply.status == control_pb2.CONTROL_STATUS_SUCCESS
            assert sorted(a.stage_id for a in reply.acks) == sorted(woken)
        else:
            assert (reply.status, reply.reason, len(reply.acks)) == (
                control_pb2.CONTROL_STATUS_SKIPPED,
                "target stages are not sleeping",
                0,
            )
        states = {s.stage_id: s.state for s in stub.ListStages(gateway_pb2.ListStagesRequest(), timeout=10).stages}
        for stage_id in STAGES:
            sleeping = stage_id in set(asleep) - woken
            assert (states[stage_id] == gateway_pb2.STAGE_STATE_SLEEPING) == sleeping, states
    finally:
        restore(stub)


_SEEDS = st.one_of(st.none(), st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
# What x-request-id metadata can carry: printable ASCII (see test_unsendable_request_id_...).
_REQUEST_IDS = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=64)
_FORMATS = st.one_of(st.sampled_from([0, 1, 2, 3, 4]), INT32)
_MAGIC = {0: b"\x89PNG", 1: b"\x89PNG", 3: b"\xff\xd8", 4: b"RIFF"}  # PNG, PNG, JPEG, WebP


@FUZZ
@given(
    request_id=_REQUEST_IDS,
    seed=_SEEDS,
    output_format=_FORMATS,
    side=st.one_of(st.none(), st.sampled_from([16, 32])),
    steps=st.one_of(st.none(), st.just(1)),
    guidance=st.one_of(st.none(), st.floats(1.0, 30.0, width=32)),
)
def test_generate_fields_round_trip_or_name_the_bad_field(stub, request_id, seed, output_format, side, steps, guidance):
    params = generation_pb2.GenerationParams(
        prompt="fuzz",
        width=side,
        height=side,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        output_format=output_format,
    )
    request = gateway_pb2.GenerateUnaryRequest(params=params, request_id=request_id)
    try:
        result = stub.GenerateUnary(request, timeout=TIMEOUT_S).result
    except grpc.RpcError as err:
        assert output_format not in (0, 1, 2, 3, 4), (err.code(), err.details())
        assert violated_fields(err) == {"params.output_format"}
        return
    assert output_format in (0, 1, 2, 3, 4), f"accepted output_format {output_format}"
    if request_id:
        assert result.request_id == request_id
    if seed is not None:
        assert result.seed == seed  # uint64 edges survive every hop
    assert (result.width, result.height) == (side or 64, side or 64)  # 64: the trained model's size
    if output_format == generation_pb2.OUTPUT_FORMAT_TENSOR:
        assert list(result.tensor.shape) == [result.height, result.width, 3]
    else:
        assert getattr(result, result.WhichOneof("image")).startswith(_MAGIC[output_format])


def _png(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (200, 40, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


# A usable starting image (32x32, the request's size), one of sides no multiple of 16, and bytes
# that are no image at all.
_INIT_IMAGES = {"none": b"", "ok": _png(32), "sides": _png(40), "garbage": b"GIF89a not really"}
MAX_IMAGES, MAX_PROMPT_BYTES, STEPS = 8, 256, 2


def _expected_feature_violations(
    output_format: int,
    num_images: int | None,
    quality: int | None,
    negative_prompt: str,
    guidance: float | None,
    strength: float | None,
    image: str,
) -> set[str]:
    """docs/API.md's rules for the request features, stated independently of core.params."""
    if image == "garbage":
        return {"params.init_image"}  # an unreadable image is refused before anything else is looked at
    bad = set()
    if output_format not in (0, 1, 2, 3, 4):
        bad.add("params.output_format")
    if num_images is not None and not 1 <= num_images <= MAX_IMAGES:
        bad.add("params.num_images")
    if quality is not None and (output_format not in (3, 4) or not 1 <= quality <= 100):
        bad.add("params.quality")
    if negative_prompt and (len(negative_prompt.encode()) > MAX_PROMPT_BYTES or guidance == 1.0):
        bad.add("params.negative_prompt")
    if image == "sides":  # 40x40: no multiple of 16, and not the 32x32 the request asks for
        bad |= {"params.init_image", "params.width", "params.height"}
    if image == "none" and strength is not None:
        bad.add("params.strength")
    if image != "none" and strength is not None and not (0 < strength <= 1 and int(STEPS * strength) >= 1):
        bad.add("params.strength")
    return bad


_FEATURES = ("output_format", "num_images", "quality", "negative_prompt", "strength", "init_image")
_OUT_OF_RANGE = st.one_of(st.integers(-(2**31), 0), st.integers(MAX_IMAGES + 1, 2**31 - 1))


@st.composite
def _feature_requests(draw) -> dict:
    """Mostly good requests: up to two fields drawn bad on purpose (often none, so that many
    requests run); the violations expected are worked out separately from the values alone."""
    bad = draw(st.sets(st.sampled_from(_FEATURES), max_size=2))
    image = draw(st.sampled_from(["sides", "garbage"] if "init_image" in bad else ["none", "ok"]))
    unknown_format = st.one_of(st.integers(-(2**31), -1), st.integers(5, 2**31 - 1))
    output_format = draw(unknown_format if "output_format" in bad else st.integers(0, 4))
    lossy = output_format in (3, 4)
    guidance = draw(st.sampled_from([None, 1.0, 4.0]))
    if "num_images" in bad:
        num_images = draw(_OUT_OF_RANGE)
    else:
        num_images = draw(st.one_of(st.none(), st.integers(1, 3)))
    if "quality" in bad:
        quality = draw(st.integers(1, 100) if not lossy else st.one_of(st.integers(-(2**31), 0), st.integers(101)))
    else:
        quality = draw(st.one_of(st.none(), st.integers(1, 100))) if lossy else None
    if "negative_prompt" in bad:
        negative_prompt = draw(st.text(min_size=1, max_size=20)) if guidance == 1.0 else "x" * 257
    else:
        negative_prompt = draw(st.text(max_size=20)) if guidance != 1.0 else ""
    if "strength" in bad:
        strength = draw(st.sampled_from([0.0, 0.25, 1.5, -1.0, math.nan] if image == "ok" else [0.5, 1.0]))
    else:
        strength = draw(st.sampled_from([None, 0.5, 0.8, 1.0])) if image == "ok" else None
    return dict(
        output_format=output_format,
        num_images=num_images,
        quality=quality,
        negative_prompt=negative_prompt,
        guidance=guidance,
        strength=strength,
        image=image,
    )


@FUZZ
@given(request=_feature_requests())
def test_feature_fields_are_honoured_or_name_the_bad_field(stub, request):
    output_format, num_images, quality, negative_prompt, guidance, strength, image = request.values()
    params = generation_pb2.GenerationParams(
        prompt="fuzz",
        width=32,
        height=32,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        seed=5,
        output_format=output_format,
        num_images=num_images,
        quality=quality,
        negative_prompt=negative_prompt,
        strength=strength,
        init_image=_INIT_IMAGES[image],
    )
    expected = _expected_feature_violations(
        output_format, num_images, quality, negative_prompt, guidance, strength, image
    )
    try:
        reply = stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=TIMEOUT_S)
    except grpc.RpcError as err:
        assert violated_fields(err) == expected, (params, err.details())
        event(f"refused: {sorted(expected)}")
        return
    assert not expected, f"accepted although {expected} are bad: {params}"
    event(f"{num_images or 1} image(s), format {output_format}, init image {image}")
    assert [(r.index, r.seed) for r in reply.results] == [(i, 5 + i) for i in range(num_images or 1)]
    field = {0: "png", 1: "png", 2: "tensor", 3: "jpeg", 4: "webp"}[output_format]
    for result in reply.results:
        assert result.WhichOneof("image") == field and (result.width, result.height) == (32, 32)
        if field != "tensor":
            with Image.open(io.BytesIO(getattr(result, field))) as decoded:
                assert decoded.size == (32, 32)


@pytest.mark.parametrize(
    "request_id", ["line\nbreak", "caf\u00e9", "nul\x00", "x" * 10_000], ids=["newline", "non-ascii", "nul", "10k"]
)
def test_unsendable_request_id_is_invalid_argument_naming_it(stub, request_id):
    params = generation_pb2.GenerationParams(prompt="id", width=16, height=16, num_inference_steps=1)
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params, request_id=request_id), timeout=TIMEOUT_S)
    assert violated_fields(info.value) == {"request_id"}


# ---- bytes that are no message at all -------------------------------------------------------------
TRUNCATED = b"\x0a\x05\x0a"  # field 1, length 5, one byte follows
BAD_WIRE_TYPE = b"\x0f"  # field 1, wire type 7 (none such)
OVERLONG_VARINT = b"\xff" * 11  # a tag varint longer than 10 bytes
MISSING_VALUE = b"\x08"  # field 1 varint, value cut off
GARBAGE = [TRUNCATED, BAD_WIRE_TYPE, OVERLONG_VARINT, MISSING_VALUE]
# (service, method, request type, streaming reply)
METHODS = [
    ("gateway", "/stagemesh.v1.GatewayService/GenerateUnary", gateway_pb2.GenerateUnaryRequest, False),
    ("gateway", "/stagemesh.v1.GatewayService/Generate", gateway_pb2.GenerateRequest, True),
    ("gateway", "/stagemesh.v1.GatewayService/Sleep", gateway_pb2.SleepRequest, False),
    ("gateway", "/stagemesh.v1.GatewayService/WakeUp", gateway_pb2.WakeUpRequest, False),
    ("stage-1", "/stagemesh.v1.StageService/Execute", stage_pb2.ExecuteRequest, True),
    ("stage-0", "/stagemesh.v1.StageService/SleepStage", stage_pb2.SleepStageRequest, False),
    ("cache", "/stagemesh.v1.CacheService/Evict", cache_pb2.EvictRequest, False),
]
CASES = [(*m, payload) for m in METHODS for payload in GARBAGE] + [
    # Well-formed wire format, but a string field (params.prompt; request_id) that is not UTF-8.
    (*METHODS[0], b"\x0a\x03\x0a\x01\xff"),
    (*METHODS[4], b"\x0a\x01\xff"),
]


def _raw_call(channel: grpc.Channel, method: str, streaming: bool, payload: bytes):
    if streaming:
        return list(channel.unary_stream(method)(payload, timeout=10))
    return channel.unary_unary(method)(payload, timeout=10)


@pytest.mark.parametrize(
    "service,method,request_type,streaming,payload",
    CASES,
    ids=[f"{c[1].rsplit('/', 1)[1]}-{c[4].hex()[:12]}" for c in CASES],
)
def test_malformed_bytes_are_refused_by_grpc_and_the_service_serves_on(
    fuzz_mesh, channel, stub, service, method, request_type, streaming, payload
):
    with pytest.raises(DecodeError):
        request_type.FromString(payload)  # the payload really is no such message
    address = fuzz_mesh.address if service == "gateway" else fuzz_mesh.child_addresses()[service]
    with grpc.insecure_channel(address) as raw, pytest.raises(grpc.RpcError) as info:
        _raw_call(raw, method, streaming, payload)
    # Refused before any servicer code runs: INVALID_ARGUMENT naming the parse failure.
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
    assert "does not parse" in info.value.details(), info.value.details()
    # The service that got the bytes still serves, and so does the whole pipeline.
    with grpc.insecure_channel(address) as again:
        health = health_pb2_grpc.HealthStub(again).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    params = generation_pb2.GenerationParams(prompt="after", width=16, height=16, num_inference_steps=1, seed=1)
    assert stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=TIMEOUT_S).result.png


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(payload=st.binary(min_size=1, max_size=64))
def test_random_unparseable_bytes_are_refused_by_grpc(channel, payload):
    try:
        gateway_pb2.SleepRequest.FromString(payload)
        assume(False)  # it parses: that is a real Sleep, the sweeps above cover those
    except DecodeError:
        pass
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary("/stagemesh.v1.GatewayService/Sleep")(payload, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
    assert "does not parse" in info.value.details()

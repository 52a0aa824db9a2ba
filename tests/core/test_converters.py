"""Each protobuf <-> domain pair of stagemesh.core.converters, and the output-format table they
read: whatever one side writes, the other reads back as it was (pure domain: no server)."""

from __future__ import annotations

import math
import typing
from dataclasses import fields, replace

from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from stagemesh.client.requests import OutputFormat, VideoFormat
from stagemesh.core import converters, formats
from stagemesh.core.acks import WorkerAck
from stagemesh.core.adapters import AdapterInfo
from stagemesh.core.events import DenoisingStep, StageStarted
from stagemesh.core.params import AdapterChoice, InitImage, Limits, resolve
from stagemesh.v1 import control_pb2, gateway_pb2, generation_pb2, stage_pb2, tensor_pb2

int32s = st.integers(-(2**31), 2**31 - 1)
# What a `float` field of a message holds exactly (NaN left out: it equals nothing, itself neither).
float32s = st.floats(width=32, allow_nan=False)
# At most 16 characters of at most 4 UTF-8 bytes: within max_prompt_bytes. Protobuf strings hold no surrogates.
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=16)


# ---- output formats --------------------------------------------------------------------------------
@given(st.sampled_from(formats.NAMES))
def test_a_format_name_round_trips_through_its_enum(name):
    assert converters.output_format_from_proto(converters.output_format_to_proto(name)) == name


@given(st.sampled_from(generation_pb2.OutputFormat.values()))
def test_every_enum_value_reads_as_a_format_that_writes_it_back(value):
    name = converters.output_format_from_proto(value)
    assert name is not None
    # UNSPECIFIED is read as the default and written back as that format's own value.
    expected = formats.DEFAULT.wire if value == generation_pb2.OUTPUT_FORMAT_UNSPECIFIED else value
    assert converters.output_format_to_proto(name) == expected


@given(int32s.filter(lambda v: v not in generation_pb2.OutputFormat.values()))
def test_an_unknown_enum_value_reads_as_no_format(value):
    assert converters.output_format_from_proto(value) is None


def test_the_table_agrees_with_the_wire_the_client_and_pillow():
    assert set(generation_pb2.OutputFormat.values()) == {f.wire for f in formats.FORMATS} | {0}
    # A format's name is the GenerationResult oneof field that carries its image.
    oneof = generation_pb2.GenerationResult.DESCRIPTOR.oneofs_by_name["image"]
    assert {field.name for field in oneof.fields} == set(formats.NAMES)
    assert set(typing.get_args(OutputFormat)) == set(formats.IMAGE_NAMES)
    assert set(typing.get_args(VideoFormat)) == set(formats.VIDEO_NAMES)
    Image.init()
    for fmt in formats.FORMATS:
        # An image format is Pillow's; MP4 is PyAV's (gateway/videos.py).
        assert fmt.encoded == (fmt.pillow in Image.SAVE or fmt is formats.MP4), fmt
        assert all(formats.by_suffix(s.upper()) is fmt for s in fmt.suffixes), fmt
    assert formats.by_suffix(".npy") is None and formats.by_suffix("") is None


# ---- stage limits ----------------------------------------------------------------------------------
_OFF_THE_WIRE = {f.name for f in fields(Limits)} - {f.name for f in stage_pb2.StageLimits.DESCRIPTOR.fields}
limits = st.builds(
    Limits,
    **{
        f.name: float32s if f.type == "float" else int32s
        for f in fields(Limits)
        if f.name not in _OFF_THE_WIRE and f.type != "bool"
    },
    max_num_images=st.integers(1, 64),
    supports_negative_prompt=st.booleans(),
    supports_init_image=st.booleans(),
    supports_adapters=st.booleans(),
    requires_init_image=st.booleans(),
)


def test_stagelimits_leaves_out_what_travels_beside_it_and_the_gateways_own_bound():
    assert _OFF_THE_WIRE == {
        "max_num_images",
        "supports_negative_prompt",
        "supports_init_image",
        "supports_adapters",
        "step_caches",
    }


@given(limits)
def test_limits_round_trip_and_what_stagelimits_does_not_carry_keeps_its_default(stage_limits):
    defaults = {name: getattr(Limits(), name) for name in _OFF_THE_WIRE}
    back = converters.limits_from_proto(converters.limits_to_proto(stage_limits))
    assert back == replace(stage_limits, **defaults)


# ---- worker acks ----------------------------------------------------------------------------------
worker_acks = st.builds(
    WorkerAck,
    stage_id=int32s,
    rank=int32s,
    ok=st.booleans(),
    level=int32s,
    freed_bytes=st.integers(-(2**63), 2**63 - 1),
    latency_ms=st.floats(allow_nan=False),
    error=texts,
)


@given(worker_acks)
def test_a_worker_ack_round_trips_through_proto(ack):
    assert converters.worker_ack_from_proto(converters.worker_ack_to_proto(ack)) == ack


@given(st.sampled_from(control_pb2.AckStatus.values()))
def test_only_a_success_status_reads_as_ok(status):
    ack = converters.worker_ack_from_proto(control_pb2.WorkerAck(status=status))
    assert ack.ok == (status == control_pb2.ACK_STATUS_SUCCESS)


# ---- adapters ---------------------------------------------------------------------------------------
adapter_infos = st.builds(
    AdapterInfo,
    name=texts,
    source=texts,
    stage_id=int32s,
    rank=int32s,
    bytes=st.integers(-(2**63), 2**63 - 1),
    on_device=st.booleans(),
    layers=int32s,
)


@given(adapter_infos)
def test_an_adapter_info_round_trips_through_proto(info):
    assert converters.adapter_info_from_proto(converters.adapter_info_to_proto(info)) == info


# ---- progress events ------------------------------------------------------------------------------
progress_events = st.builds(StageStarted, int32s, texts) | st.builds(DenoisingStep, int32s, int32s, int32s, int32s)


@given(progress_events)
def test_a_progress_event_round_trips_through_proto(event):
    assert converters.progress_from_proto(converters.progress_to_proto(event)) == event


def test_a_result_is_no_progress_event():
    msg = gateway_pb2.GenerateResponse(result=generation_pb2.GenerationResult(png=b"\x89PNG"))
    assert converters.progress_from_proto(msg) is None


# ---- generation parameters -------------------------------------------------------------------------
FULL = Limits(
    pixel_multiple=16,
    max_pixels_side=256,
    max_inference_steps=50,
    max_prompt_bytes=64,
    max_num_images=4,
    supports_negative_prompt=True,
    supports_init_image=True,
    supports_adapters=True,
)
sides = st.integers(1, FULL.max_pixels_side // FULL.pixel_multiple).map(lambda n: n * FULL.pixel_multiple)


@st.composite
def params(draw):
    """A request as resolve() accepts it: every field set or left to its default."""
    image = draw(st.none() | st.builds(InitImage, sides, sides))
    steps = draw(st.integers(1, FULL.max_inference_steps))
    guidance = draw(st.floats(1.0, FULL.max_guidance_scale, width=32))
    output_format = draw(st.sampled_from(formats.IMAGE_NAMES))
    # Distinct adapter names, each at a scale a client writes (a decimal of up to 4 digits).
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True), max_size=4, unique=True))
    scales = [draw(st.integers(-8000, 8000)) / 1000 for _ in names]
    adapters = tuple(AdapterChoice(n, s) for n, s in zip(names, scales))
    strength = None
    if image is not None:
        # As a client writes it: a decimal of up to 6 digits, leaving at least one denoising step.
        strength = draw(st.integers(math.ceil(10**6 / steps), 10**6)) / 10**6
    return resolve(
        prompt=draw(texts),
        width=draw(st.none() | (st.just(image.width) if image else sides)),
        height=draw(st.none() | (st.just(image.height) if image else sides)),
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=draw(st.none() | st.integers(0, 2**64 - 1)),
        output_format=output_format,
        limits=FULL,
        negative_prompt=draw(texts) if guidance != 1.0 else "",
        num_images=draw(st.none() | st.integers(1, FULL.max_num_images)),
        quality=draw(st.integers(1, 100)) if output_format in formats.LOSSY_NAMES else None,
        strength=strength,
        init_image=image,
        adapters=adapters,
    )


@given(params())
def test_params_round_trip_through_proto(p):
    wire = converters.params_to_proto(p)
    assert not wire.init_image  # stages receive the starting image decoded, as a tensor input
    assert converters.params_from_proto(wire, FULL, p.init_image) == p


VIDEO = replace(FULL, frame_step=4, max_num_frames=81, default_num_frames=81, default_fps=16)


@st.composite
def video_params(draw):
    """A video model's request: frames and fps given or left to the model's defaults."""
    output_format = draw(st.sampled_from(formats.VIDEO_NAMES))
    return resolve(
        prompt=draw(texts),
        width=draw(sides),
        height=draw(sides),
        num_inference_steps=draw(st.integers(1, FULL.max_inference_steps)),
        guidance_scale=draw(st.floats(1.0, FULL.max_guidance_scale, width=32)),
        seed=draw(st.integers(0, 2**64 - 1)),
        output_format=output_format,
        limits=VIDEO,
        quality=draw(st.integers(1, 100)) if output_format in formats.LOSSY_NAMES else None,
        num_frames=draw(st.none() | st.integers(0, 20).map(lambda k: 4 * k + 1)),
        fps=draw(st.none() | st.integers(1, 120)),
    )


@given(video_params())
def test_video_params_round_trip_through_proto(p):
    assert p.video and p.num_frames % 4 == 1 and p.fps
    assert converters.params_from_proto(converters.params_to_proto(p), VIDEO) == p


def test_an_unnamed_format_is_png_for_an_image_model_and_mp4_for_a_video_model():
    wire = generation_pb2.GenerationParams(prompt="a", width=32, height=32)
    assert converters.params_from_proto(wire, FULL).output_format == "png"
    video = converters.params_from_proto(wire, VIDEO)
    assert (video.output_format, video.num_frames, video.fps) == ("mp4", 81, 16)


# ---- results in chunks -----------------------------------------------------------------------------
results = st.builds(
    lambda which, data, index: _result(which, data, index),
    st.sampled_from(["mp4", "webp", "png", "tensor"]),
    st.binary(max_size=300),
    st.integers(0, 7),
)


def _result(which: str, data: bytes, index: int) -> generation_pb2.GenerationResult:
    result = generation_pb2.GenerationResult(request_id="r", index=index, num_frames=5, fps=16, width=2, height=2)
    if which == "tensor":
        result.tensor.CopyFrom(tensor_pb2.Tensor(dtype="uint8", shape=[len(data)], data=data))
    else:
        setattr(result, which, data)
    return result


@given(results, st.integers(1, 64))
def test_a_result_round_trips_through_its_chunks(result, chunk_bytes):
    events = converters.result_to_events(result, chunk_bytes)
    assembler = converters.ResultAssembler()
    for event in events[:-1]:
        assert len(event.result_chunk.data) <= chunk_bytes and event.result_chunk.index == result.index
        assembler.add_chunk(event.result_chunk)
    last = events[-1].result
    assert last.WhichOneof("image") == result.WhichOneof("image")  # the head names the payload's field
    assert assembler.complete(last) == result
    size = len(result.tensor.data) if result.HasField("tensor") else len(getattr(result, result.WhichOneof("image")))
    assert len(events) == (1 if size <= chunk_bytes else 1 + -(-size // chunk_bytes))


def test_a_missing_chunk_is_noticed():
    events = converters.result_to_events(_result("mp4", bytes(100), 0), 10)
    assembler = converters.ResultAssembler()
    assembler.add_chunk(events[0].result_chunk)
    try:
        assembler.add_chunk(events[2].result_chunk)
    except ValueError as exc:
        assert "offset 20 after 10 bytes" in str(exc)
    else:
        raise AssertionError("a gap was accepted")


@given(st.sampled_from([f for f in formats.FORMATS if not f.lossy]), st.integers(1, 100))
def test_quality_is_sent_only_with_a_format_that_takes_one(fmt, quality):
    p = resolve(
        prompt="a",
        width=None,
        height=None,
        num_inference_steps=None,
        guidance_scale=None,
        seed=1,
        output_format=fmt.name,
        limits=FULL,
    )
    assert not converters.params_to_proto(p).HasField("quality")
    lossy = replace(p, output_format=formats.JPEG.name, quality=quality)
    assert converters.params_to_proto(lossy).quality == quality
    assert converters.params_from_proto(converters.params_to_proto(lossy), FULL) == lossy

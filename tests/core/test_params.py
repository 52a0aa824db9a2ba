"""Parameter defaults and validation (pure domain: no server)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from stagemesh.core import converters
from stagemesh.core.errors import FieldViolation, InvalidArgument
from stagemesh.core.params import InitImage, Limits, resolve
from stagemesh.v1 import generation_pb2

LIMITS = Limits(pixel_multiple=16, max_pixels_side=512, max_inference_steps=50, max_prompt_bytes=10)


def _resolve(**kw):
    base = dict(
        prompt="hi",
        width=None,
        height=None,
        num_inference_steps=None,
        guidance_scale=None,
        seed=None,
        output_format="png",
        limits=LIMITS,
    )
    base.update(kw)
    return resolve(**base)


def test_defaults_fill_unset_fields():
    p = _resolve()
    assert (p.width, p.height, p.num_inference_steps, p.guidance_scale) == (256, 256, 8, 4.0)
    assert 0 <= p.seed < 2**63


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("width", 0, "must be positive"),
        ("width", -16, "must be positive"),
        ("height", 17, "not a multiple of 16"),
        ("width", 528, "above the maximum 512"),
        ("num_inference_steps", 0, "allowed: 1 to 50"),
        ("num_inference_steps", 51, "allowed: 1 to 50"),
        ("guidance_scale", 0.5, "allowed: 1.0 to 30.0"),
        ("guidance_scale", math.nan, "allowed: 1.0 to 30.0"),
        ("output_format", "gif", "allowed: PNG, TENSOR, JPEG, WEBP"),
        ("prompt", "é" * 6, "at most 10 UTF-8 bytes"),
    ],
)
def test_each_bad_field_is_named_with_its_range(field, value, needle):
    with pytest.raises(InvalidArgument) as info:
        _resolve(**{field: value})
    [violation] = info.value.violations
    assert violation.field == f"params.{field}"
    assert needle in violation.description


def test_all_bad_fields_are_reported_together():
    with pytest.raises(InvalidArgument) as info:
        _resolve(width=0, height=3, num_inference_steps=99)
    assert [v.field for v in info.value.violations] == ["params.width", "params.height", "params.num_inference_steps"]


def test_proto_presence_distinguishes_unset_from_zero():
    unset = converters.params_from_proto(generation_pb2.GenerationParams(prompt="a"), LIMITS)
    assert unset.width == 256
    with pytest.raises(InvalidArgument):
        converters.params_from_proto(generation_pb2.GenerationParams(prompt="a", width=0), LIMITS)


def test_params_round_trip_through_proto():
    p = _resolve(width=32, height=48, num_inference_steps=3, guidance_scale=2.5, seed=9, output_format="tensor")
    assert converters.params_from_proto(converters.params_to_proto(p), LIMITS) == p


def test_unknown_output_format_enum_is_refused():
    with pytest.raises(InvalidArgument) as info:
        converters.params_from_proto(generation_pb2.GenerationParams(prompt="a", output_format=99), LIMITS)
    assert info.value.violations[0].field == "params.output_format"


# ---- negative_prompt, num_images, quality, init_image, strength ----------------------------------
FULL = Limits(
    pixel_multiple=16,
    max_pixels_side=512,
    max_inference_steps=50,
    max_prompt_bytes=10,
    max_num_images=4,
    supports_negative_prompt=True,
    supports_init_image=True,
)
IMAGE = InitImage(64, 48)


def _one_violation(**kw) -> FieldViolation:
    with pytest.raises(InvalidArgument) as info:
        _resolve(**{"limits": FULL, **kw})
    [violation] = info.value.violations
    assert "allowed" in violation.description, violation
    return violation


def test_new_fields_have_defaults():
    p = _resolve(limits=FULL)
    assert (p.negative_prompt, p.num_images, p.quality, p.strength, p.init_image) == ("", 1, 90, None, None)
    assert p.first_step == 0
    with_image = _resolve(limits=FULL, init_image=IMAGE, num_inference_steps=10)
    # The size is the starting image's; strength defaults to 0.8: the last 8 of 10 steps run.
    assert (with_image.width, with_image.height, with_image.strength, with_image.first_step) == (64, 48, 0.8, 2)


@pytest.mark.parametrize(
    "fields,field,needles",
    [
        (dict(num_images=0), "num_images", ["0", "1 to 4"]),
        (dict(num_images=5), "num_images", ["5", "1 to 4"]),
        (dict(quality=0, output_format="jpeg"), "quality", ["0", "1 to 100"]),
        (dict(quality=101, output_format="webp"), "quality", ["101", "1 to 100"]),
        (dict(quality=80), "quality", ["JPEG and WEBP only", "PNG"]),
        (dict(quality=80, output_format="tensor"), "quality", ["TENSOR"]),
        (dict(strength=0.5), "strength", ["without an init_image", "unset"]),
        (dict(strength=0.0, init_image=IMAGE), "strength", ["0", "above 0 up to 1"]),
        (dict(strength=1.5, init_image=IMAGE), "strength", ["1.5", "above 0 up to 1"]),
        (dict(strength=math.nan, init_image=IMAGE), "strength", ["nan", "above 0 up to 1"]),
        (dict(strength=0.05, init_image=IMAGE, num_inference_steps=10), "strength", ["no denoising step", "0.1"]),
        (dict(init_image=InitImage(60, 48)), "init_image", ["60x48", "multiples of 16"]),
        (dict(init_image=InitImage(1024, 48)), "init_image", ["1024x48", "512"]),
        (dict(init_image=IMAGE, width=32), "width", ["32", "init_image's width 64", "unset or 64"]),
        (dict(init_image=IMAGE, height=64), "height", ["64", "init_image's height 48", "unset or 48"]),
        (dict(negative_prompt="é" * 6), "negative_prompt", ["12 bytes", "at most 10"]),
        (dict(negative_prompt="dull", guidance_scale=1.0), "negative_prompt", ["guidance_scale 1.0"]),
        (dict(output_format="gif"), "output_format", ["PNG, TENSOR, JPEG, WEBP"]),
    ],
)
def test_each_new_bad_field_is_named_with_what_is_allowed(fields, field, needles):
    violation = _one_violation(**fields)
    assert violation.field == f"params.{field}"
    for needle in needles:
        assert needle in violation.description, (needle, violation.description)


def test_what_the_pipeline_cannot_use_is_refused_not_ignored():
    plain = Limits()  # a stage's own limits: one image, no negative prompt, no starting image
    for fields, field in [
        (dict(negative_prompt="dull"), "params.negative_prompt"),
        (dict(init_image=InitImage(64, 64)), "params.init_image"),
        (dict(num_images=2), "params.num_images"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            _resolve(limits=plain, **fields)
        assert [v.field for v in info.value.violations] == [field]


def test_new_fields_round_trip_through_proto():
    p = _resolve(
        limits=FULL,
        negative_prompt="dull",
        num_images=3,
        quality=70,
        output_format="webp",
        strength=0.7,
        init_image=IMAGE,
        num_inference_steps=10,
        seed=5,
    )
    wire = converters.params_to_proto(p)
    assert not wire.init_image  # stages receive the pixels as a tensor input
    assert converters.params_from_proto(wire, FULL, IMAGE) == replace(p, init_image=IMAGE)
    # The float32 on the wire reads back as the decimal written: int(10 * 0.7) is 7 steps, not 6.
    assert converters.params_from_proto(wire, FULL, IMAGE).first_step == 3
    assert not converters.params_to_proto(replace(p, output_format="png")).HasField("quality")


def test_encoded_image_bytes_need_the_reader_to_have_probed_them():
    msg = generation_pb2.GenerationParams(prompt="a", init_image=b"\x89PNG")
    with pytest.raises(InvalidArgument) as info:
        converters.params_from_proto(msg, FULL)
    assert info.value.violations[0].field == "params.init_image"


@pytest.mark.parametrize("name,enum", [("jpeg", 3), ("webp", 4)])
def test_jpeg_and_webp_formats(name, enum):
    msg = generation_pb2.GenerationParams(prompt="a", output_format=enum, quality=55)
    p = converters.params_from_proto(msg, FULL)
    assert (p.output_format, p.quality) == (name, 55)


# ---- video -----------------------------------------------------------------------------------------
VIDEO = replace(LIMITS, frame_step=4, max_num_frames=33, default_num_frames=17, default_fps=16)
I2V = replace(VIDEO, supports_init_image=True, requires_init_image=True)


def test_a_video_model_fills_frames_fps_and_mp4():
    p = _resolve(limits=VIDEO, output_format="mp4")
    assert (p.num_frames, p.fps, p.video) == (17, 16, True)
    assert not _resolve().video and (_resolve().num_frames, _resolve().fps) == (0, 0)


@pytest.mark.parametrize(
    ("limits", "fields", "field", "needles"),
    [
        # video parameters sent to an image model
        (LIMITS, {"num_frames": 5}, "num_frames", ["image model", "allowed: unset"]),
        (LIMITS, {"fps": 24}, "fps", ["image model", "allowed: unset"]),
        (LIMITS, {"output_format": "mp4"}, "output_format", ["MP4 is not an output of an image model", "PNG"]),
        # image parameters and frame counts a video model cannot take
        (VIDEO, {"num_frames": 6}, "num_frames", ["6 frames", "4k + 1 from 1 to 33 (1, 5, 9, 13, ... 33)"]),
        (VIDEO, {"num_frames": 37}, "num_frames", ["37", "to 33"]),
        (VIDEO, {"num_frames": 0}, "num_frames", ["0 frames", "4k + 1"]),
        (VIDEO, {"fps": 0}, "fps", ["1 to 120"]),
        (VIDEO, {"output_format": "png"}, "output_format", ["not an output of a video model", "TENSOR, WEBP, MP4"]),
        (VIDEO, {"strength": 0.5}, "strength", ["video model", "allowed: unset"]),
        (VIDEO, {"init_image": InitImage(32, 32)}, "init_image", ["cannot start from an image"]),
        (I2V, {}, "init_image", ["is empty", "image-to-video"]),
        (VIDEO, {"quality": 50, "output_format": "tensor"}, "quality", ["WEBP and MP4 only"]),
    ],
)
def test_video_and_image_parameters_are_refused_where_they_do_not_apply(limits, fields, field, needles):
    base = {"output_format": "mp4"} if limits.video else {}
    with pytest.raises(InvalidArgument) as info:
        _resolve(limits=limits, **{**base, **fields})
    [violation] = info.value.violations
    assert violation.field == f"params.{field}"
    for needle in needles:
        assert needle in violation.description, (needle, violation.description)


def test_an_image_to_video_request_takes_its_size_from_the_start_image():
    p = _resolve(limits=I2V, output_format="mp4", init_image=InitImage(64, 48))
    assert (p.width, p.height, p.strength, p.num_frames) == (64, 48, None, 17)

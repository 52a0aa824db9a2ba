"""Parameter defaults and validation (pure domain: no server)."""

from __future__ import annotations

import math

import pytest

from stagemesh.core import converters
from stagemesh.core.errors import InvalidArgument
from stagemesh.core.params import Limits, resolve
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
        ("output_format", "gif", "allowed: PNG, TENSOR"),
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

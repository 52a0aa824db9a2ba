"""Protobuf <-> domain conversions shared by the gateway and the stage service."""

from __future__ import annotations

from stagemesh.core import params as gp
from stagemesh.core.errors import InvalidArgument
from stagemesh.v1 import generation_pb2

_FORMAT_NAMES = {
    generation_pb2.OUTPUT_FORMAT_UNSPECIFIED: gp.OUTPUT_PNG,
    generation_pb2.OUTPUT_FORMAT_PNG: gp.OUTPUT_PNG,
    generation_pb2.OUTPUT_FORMAT_TENSOR: gp.OUTPUT_TENSOR,
}
_FORMAT_ENUMS = {gp.OUTPUT_PNG: generation_pb2.OUTPUT_FORMAT_PNG, gp.OUTPUT_TENSOR: generation_pb2.OUTPUT_FORMAT_TENSOR}


def params_from_proto(msg: generation_pb2.GenerationParams, limits: gp.Limits) -> gp.Params:
    fmt = _FORMAT_NAMES.get(msg.output_format)
    return gp.resolve(
        prompt=msg.prompt,
        width=msg.width if msg.HasField("width") else None,
        height=msg.height if msg.HasField("height") else None,
        num_inference_steps=msg.num_inference_steps if msg.HasField("num_inference_steps") else None,
        guidance_scale=msg.guidance_scale if msg.HasField("guidance_scale") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        output_format=fmt if fmt is not None else f"enum value {msg.output_format}",
        limits=limits,
    )


def params_to_proto(p: gp.Params) -> generation_pb2.GenerationParams:
    return generation_pb2.GenerationParams(
        prompt=p.prompt,
        width=p.width,
        height=p.height,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        seed=p.seed,
        output_format=_FORMAT_ENUMS[p.output_format],
    )


def output_format_enum(name: str) -> generation_pb2.OutputFormat:
    return _FORMAT_ENUMS[name]


def require_field(condition: bool, field: str, description: str) -> None:
    if not condition:
        raise InvalidArgument.field(field, description)

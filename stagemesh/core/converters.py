"""Protobuf <-> domain conversions shared by the gateway, the stage service and the client: each
a pair, X_to_proto beside X_from_proto, so that what one side writes the other reads back
(tests/core/test_converters.py checks every pair round trip)."""

from __future__ import annotations

from stagemesh.core import formats
from stagemesh.core import params as gp
from stagemesh.core.acks import WorkerAck
from stagemesh.core.errors import InvalidArgument
from stagemesh.core.events import DenoisingStep, StageStarted
from stagemesh.v1 import control_pb2, gateway_pb2, generation_pb2, stage_pb2

# Limits' fields that StageLimits carries, by the same names. What a stage can use beyond a
# prompt travels beside them, on DescribeStageResponse; max_num_images is the gateway's own.
_LIMITS_FIELDS = tuple(f.name for f in stage_pb2.StageLimits.DESCRIPTOR.fields)


def output_format_to_proto(name: str) -> generation_pb2.OutputFormat:
    """KeyError for a name outside formats.NAMES."""
    return formats.by_name(name).wire


def output_format_from_proto(value: int) -> str | None:
    """The format's name (UNSPECIFIED reads as the default, PNG: params_from_proto makes it MP4
    for a video model); None for an unknown value."""
    fmt = formats.by_wire(value)
    return None if fmt is None else fmt.name


def limits_to_proto(limits: gp.Limits) -> stage_pb2.StageLimits:
    return stage_pb2.StageLimits(**{name: getattr(limits, name) for name in _LIMITS_FIELDS})


def limits_from_proto(msg: stage_pb2.StageLimits) -> gp.Limits:
    """The fields StageLimits does not carry keep Limits' defaults."""
    return gp.Limits(**{name: getattr(msg, name) for name in _LIMITS_FIELDS})


def _decimal(value: float) -> float:
    """The float32 the wire carries, read back as the decimal a client wrote (0.7, not
    0.699999988): int(steps * strength) must count the steps the client meant."""
    return float(f"{value:.7g}")


def params_from_proto(
    msg: generation_pb2.GenerationParams, limits: gp.Limits, init_image: gp.InitImage | None = None
) -> gp.Params:
    """`init_image`: the starting image as its reader found it (the gateway probes the bytes of
    msg.init_image; a stage measures its INIT_IMAGE_INPUT); bytes in msg.init_image alone are refused."""
    fmt = output_format_from_proto(msg.output_format)
    if msg.output_format == generation_pb2.OUTPUT_FORMAT_UNSPECIFIED and limits.video:
        fmt = formats.DEFAULT_VIDEO.name
    if msg.init_image and init_image is None:
        raise InvalidArgument.field(
            "params.init_image",
            f"a stage takes the starting image decoded, as inputs[{gp.INIT_IMAGE_INPUT}] (uint8 [height, width, 3]); "
            "allowed here: empty",
        )
    return gp.resolve(
        prompt=msg.prompt,
        width=msg.width if msg.HasField("width") else None,
        height=msg.height if msg.HasField("height") else None,
        num_inference_steps=msg.num_inference_steps if msg.HasField("num_inference_steps") else None,
        guidance_scale=msg.guidance_scale if msg.HasField("guidance_scale") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        output_format=fmt if fmt is not None else f"enum value {msg.output_format}",
        limits=limits,
        negative_prompt=msg.negative_prompt,
        num_images=msg.num_images if msg.HasField("num_images") else None,
        quality=msg.quality if msg.HasField("quality") else None,
        strength=_decimal(msg.strength) if msg.HasField("strength") else None,
        init_image=init_image,
        num_frames=msg.num_frames if msg.HasField("num_frames") else None,
        fps=msg.fps if msg.HasField("fps") else None,
    )


def params_to_proto(p: gp.Params) -> generation_pb2.GenerationParams:
    """Every field but the starting image's bytes (stages receive it decoded, as a tensor input)."""
    return generation_pb2.GenerationParams(
        prompt=p.prompt,
        width=p.width,
        height=p.height,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        seed=p.seed,
        output_format=output_format_to_proto(p.output_format),
        negative_prompt=p.negative_prompt or None,
        num_images=p.num_images,
        quality=p.quality if p.output_format in gp.LOSSY_FORMATS else None,
        strength=p.strength,
        num_frames=p.num_frames or None,
        fps=p.fps or None,
    )


def worker_ack_to_proto(ack: WorkerAck) -> control_pb2.WorkerAck:
    return control_pb2.WorkerAck(
        stage_id=ack.stage_id,
        rank=ack.rank,
        status=control_pb2.ACK_STATUS_SUCCESS if ack.ok else control_pb2.ACK_STATUS_ERROR,
        freed_bytes=ack.freed_bytes,
        latency_ms=ack.latency_ms,
        level=ack.level,
        error=ack.error,
    )


def worker_ack_from_proto(msg: control_pb2.WorkerAck) -> WorkerAck:
    """Only ACK_STATUS_SUCCESS reads as ok."""
    return WorkerAck(
        stage_id=msg.stage_id,
        rank=msg.rank,
        ok=msg.status == control_pb2.ACK_STATUS_SUCCESS,
        level=msg.level,
        freed_bytes=msg.freed_bytes,
        latency_ms=msg.latency_ms,
        error=msg.error,
    )


def progress_to_proto(event: StageStarted | DenoisingStep) -> gateway_pb2.GenerateResponse:
    if isinstance(event, StageStarted):
        return gateway_pb2.GenerateResponse(
            stage_started=gateway_pb2.StageStarted(stage_id=event.stage_id, kind=event.kind)
        )
    return gateway_pb2.GenerateResponse(
        denoising_step=gateway_pb2.DenoisingStep(
            stage_id=event.stage_id, step=event.step, total=event.total, index=event.index
        )
    )


def progress_from_proto(msg: gateway_pb2.GenerateResponse) -> StageStarted | DenoisingStep | None:
    """None for a message that carries no progress (a result)."""
    which = msg.WhichOneof("event")
    if which == "stage_started":
        return StageStarted(msg.stage_started.stage_id, msg.stage_started.kind)
    if which == "denoising_step":
        step = msg.denoising_step
        return DenoisingStep(step.stage_id, step.step, step.total, step.index)
    return None


def require_field(condition: bool, field: str, description: str) -> None:
    if not condition:
        raise InvalidArgument.field(field, description)

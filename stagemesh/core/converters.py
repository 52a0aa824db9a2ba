"""Protobuf <-> domain conversions shared by the gateway, the stage service and the client: each
a pair, X_to_proto beside X_from_proto, so that what one side writes the other reads back
(tests/core/test_converters.py checks every pair round trip)."""

from __future__ import annotations

import dataclasses

from stagemesh.core import formats
from stagemesh.core import params as gp
from stagemesh.core.acks import WorkerAck
from stagemesh.core.adapters import AdapterInfo
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
        step_cache=msg.step_cache if msg.HasField("step_cache") else None,
        step_cache_threshold=_decimal(msg.step_cache_threshold) if msg.HasField("step_cache_threshold") else None,
        adapters=adapters_from_proto(msg.adapters),
        num_frames=msg.num_frames if msg.HasField("num_frames") else None,
        fps=msg.fps if msg.HasField("fps") else None,
    )


def adapters_from_proto(choices) -> tuple[gp.AdapterChoice, ...]:
    return tuple(gp.AdapterChoice(c.name, _decimal(c.scale) if c.HasField("scale") else 1.0) for c in choices)


def adapters_to_proto(choices: tuple[gp.AdapterChoice, ...]) -> list[generation_pb2.AdapterChoice]:
    return [generation_pb2.AdapterChoice(name=c.name, scale=c.scale) for c in choices]


def adapter_info_to_proto(info: AdapterInfo) -> control_pb2.AdapterInfo:
    return control_pb2.AdapterInfo(**dataclasses.asdict(info))


def adapter_info_from_proto(msg: control_pb2.AdapterInfo) -> AdapterInfo:
    return AdapterInfo(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(AdapterInfo)})


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
        step_cache=p.step_cache,
        step_cache_threshold=p.step_cache_threshold,
        adapters=adapters_to_proto(p.adapters),
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


def _payload(result: generation_pb2.GenerationResult) -> tuple[str | None, bytes]:
    """(the oneof field carrying the result, its bytes: tensor.data for a tensor)."""
    which = result.WhichOneof("image")
    if which is None:
        return None, b""
    return which, result.tensor.data if which == "tensor" else getattr(result, which)


def result_to_events(result: generation_pb2.GenerationResult, chunk_bytes: int) -> list[gateway_pb2.GenerateResponse]:
    """A result as Generate's stream carries it: one result event, or, when its payload passes
    `chunk_bytes`, ResultChunk events of at most that many bytes each ahead of the result event,
    whose payload is then empty (a tensor keeps its dtype and shape) and whose chunked_bytes says
    how many bytes came. `result_from_events` reads them back."""
    which, data = _payload(result)
    if len(data) <= chunk_bytes or which is None:
        return [gateway_pb2.GenerateResponse(result=result)]
    head = generation_pb2.GenerationResult()
    head.CopyFrom(result)
    if which == "tensor":
        head.tensor.data = b""
    else:
        setattr(head, which, b"")
    head.chunked_bytes = len(data)
    chunks = [
        gateway_pb2.GenerateResponse(
            result_chunk=generation_pb2.ResultChunk(
                index=result.index, offset=start, data=data[start : start + chunk_bytes]
            )
        )
        for start in range(0, len(data), chunk_bytes)
    ]
    return [*chunks, gateway_pb2.GenerateResponse(result=head)]


class ResultAssembler:
    """The reader's side of `result_to_events`: feed it each result_chunk, then hand it the result
    event to get the whole result back."""

    def __init__(self) -> None:
        self._pieces: dict[int, list[bytes]] = {}
        self._received: dict[int, int] = {}

    def add_chunk(self, chunk: generation_pb2.ResultChunk) -> None:
        received = self._received.get(chunk.index, 0)
        if chunk.offset != received:
            raise ValueError(f"result {chunk.index}: a chunk at offset {chunk.offset} after {received} bytes")
        self._pieces.setdefault(chunk.index, []).append(chunk.data)
        self._received[chunk.index] = received + len(chunk.data)

    def complete(self, result: generation_pb2.GenerationResult) -> generation_pb2.GenerationResult:
        if not result.chunked_bytes:
            return result
        data = b"".join(self._pieces.pop(result.index, []))
        self._received.pop(result.index, None)
        if len(data) != result.chunked_bytes:
            raise ValueError(f"result {result.index}: {len(data)} bytes came of the {result.chunked_bytes} announced")
        whole = generation_pb2.GenerationResult()
        whole.CopyFrom(result)
        whole.chunked_bytes = 0
        which = result.WhichOneof("image")
        if which == "tensor":
            whole.tensor.data = data
        elif which is not None:
            setattr(whole, which, data)
        return whole

"""The request path: validate, run stage 0 -> stage N for each image of the request (the images
at once, so a stage batches them) with the deadline passed on at each hop, turn each image into
the requested format."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from stagemesh.core import codec, converters, errors, logs, shared_tensors, tracing
from stagemesh.core.events import DenoisingStep, StageStarted
from stagemesh.core.params import INIT_IMAGE_INPUT, OUTPUT_TENSOR, STEP_CACHE_OUTPUT, STEP_CACHES, Limits, Params
from stagemesh.gateway.control import Admission, AdmissionTicket
from stagemesh.gateway.fanout import merged
from stagemesh.gateway.images import decode_init_image, encode, probe_init_image
from stagemesh.gateway.settings import DEFAULT_MAX_IMAGES_PER_REQUEST
from stagemesh.gateway.stages import StageClient
from stagemesh.gateway.videos import encode_video
from stagemesh.v1 import gateway_pb2, generation_pb2, tensor_pb2

log = logs.get_logger("stagemesh.gateway")

DESCRIBE_TIMEOUT_S = 2.0
NO_DEADLINE_S = 24 * 3600.0
# Below this many pixels a PNG encodes in well under a millisecond: cheaper on the event loop
# than a round trip through a worker thread. Larger images must not block the loop.
INLINE_ENCODE_PIXELS = 64 * 64
# Stages that denoise: their progress is reported as denoising steps, and they guide.
DENOISING_KINDS = ("diffusion", "denoise")
_SEEDS = 2**64  # a seed is a uint64: image i's seed + i wraps around
EXECUTE_METHOD = "stagemesh.v1.StageService/Execute"
# A video model's last stage names its frames so (float32 [frames, height, width, 3] in [0, 1]).
VIDEO_OUTPUT = "video"


class _AllStarted:
    """Releases the admission ticket once every image of the request is in the first stage."""

    def __init__(self, ticket: AdmissionTicket, images: int) -> None:
        self._ticket = ticket
        self._waiting = images

    async def __call__(self) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            await self._ticket.release()


class Pipeline:
    def __init__(
        self,
        stages: list[StageClient],
        admission: Admission,
        max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST,
        shared_memory: bool = False,
    ):
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        self.stages = stages
        self.admission = admission
        self.max_images_per_request = max_images_per_request
        # The stages share this host's /dev/shm: their large outputs come as segments (the
        # gateway passes them on unread, or reads the last stage's picture from one).
        self.shared_memory = shared_memory

    async def wait_until_ready(self, poll_s: float = 0.1) -> None:
        """Block until every stage has described itself as ready (the gateway's load step)."""
        for stage in self.stages:
            while True:
                try:
                    reply = await stage.describe(DESCRIBE_TIMEOUT_S, wait_for_ready=True)
                    if reply.ready:
                        break
                except errors.StagemeshError as exc:
                    log.info("waiting for stage", stage_id=stage.stage_id, reason=str(exc))
                await asyncio.sleep(poll_s)
            log.info("stage ready", stage_id=stage.stage_id, kind=stage.kind)

    @property
    def limits(self) -> Limits:
        """The last stage (the one that draws) sets the image limits; the prompt and frame limits
        are the tightest. A negative prompt needs the stage that reads the prompt and every denoising
        stage to use it; a starting image goes to the stages that take one (at least one)."""
        last = self.stages[-1].limits or Limits()
        guiding = [self.stages[0], *(s for s in self.stages if s.kind in DENOISING_KINDS)]
        # Every stage of a video model checks num_frames against its own max_frames: the tightest holds.
        frames = min([(s.limits or last).max_num_frames for s in self.stages if (s.limits or last).video] or [0])
        return dataclasses.replace(
            last,
            max_num_frames=frames,
            default_num_frames=min(last.default_num_frames, frames),
            max_prompt_bytes=min((s.limits or last).max_prompt_bytes for s in self.stages),
            max_num_images=self.max_images_per_request,
            supports_negative_prompt=all(s.supports_negative_prompt for s in guiding),
            supports_init_image=any(s.supports_init_image for s in self.stages),
            # The stage that needs init_image (an edit model's) may not be the last one.
            requires_init_image=any((s.limits or last).requires_init_image for s in self.stages),
            supports_adapters=any(s.supports_adapters for s in self.stages),
        )

    def resolve(self, params: generation_pb2.GenerationParams) -> Params:
        """Validate and fill defaults; a starting image is checked from its header here and
        decoded by `generate`."""
        limits = self.limits
        image = probe_init_image(params.init_image, limits) if params.init_image else None
        return converters.params_from_proto(params, limits, image)

    async def generate(self, request_id: str, params: Params, time_remaining: float | None) -> AsyncIterator[object]:
        """Yield StageStarted (once per stage) and DenoisingStep events of every image, and one
        GenerationResult per image as each is ready. One admission ticket covers the request; if
        one image fails, the others are cancelled and the error is raised."""
        deadline = time.monotonic() + (time_remaining if time_remaining is not None else NO_DEADLINE_S)
        if tracing.ON:
            tracing.annotate_current(
                images=params.num_images, width=params.width, height=params.height, steps=params.num_inference_steps
            )
        start_image = await self._start_image(params)  # a bad image is refused before admission
        ticket = self.admission.enter()  # FAILED_PRECONDITION while paused or a stage sleeps
        try:
            started = _AllStarted(ticket, params.num_images)
            images = [
                self._run_image(request_id, params, index, start_image, deadline, started)
                for index in range(params.num_images)
            ]
            announced: set[int] = set()
            stream = _one(images[0]) if len(images) == 1 else merged(images)
            async for _, event in stream:
                if isinstance(event, StageStarted):
                    if event.stage_id in announced:
                        continue
                    announced.add(event.stage_id)
                yield event
        finally:
            await ticket.release()

    @staticmethod
    async def _start_image(params: Params) -> tensor_pb2.Tensor | None:
        if params.init_image is None:
            return None
        image = params.init_image
        return await asyncio.to_thread(lambda: codec.from_array(decode_init_image(image)))

    def _wire_params(self, stage: StageClient, params: Params) -> generation_pb2.GenerationParams:
        """What `stage` is told: a stage that cannot use a negative prompt or a starting image
        does not hear of them (it would refuse them)."""
        wire = converters.params_to_proto(params)
        if not stage.supports_negative_prompt:
            wire.ClearField("negative_prompt")
        if not stage.supports_init_image:
            wire.ClearField("strength")
        if stage.kind not in DENOISING_KINDS:  # step caching is the denoising stage's alone
            wire.ClearField("step_cache")
            wire.ClearField("step_cache_threshold")
        if not stage.supports_adapters:
            wire.ClearField("adapters")
        return wire

    async def _run_image(
        self,
        request_id: str,
        request: Params,
        index: int,
        start_image: tensor_pb2.Tensor | None,
        deadline: float,
        on_started: Callable[[], Awaitable[None]],
    ) -> AsyncGenerator[object, None]:
        """One image of the request through every stage: image `index` is drawn with seed + index."""
        params = dataclasses.replace(request, seed=(request.seed + index) % _SEEDS, num_images=1)
        inputs: dict = {}
        step_cache = None  # the STEP_CACHE_OUTPUT tensor of a denoising stage whose cache ran
        latency: dict[str, float] = {}
        received = _Received()
        try:
            for position, stage in enumerate(self.stages):
                yield StageStarted(stage.stage_id, stage.kind)
                started = time.perf_counter()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise errors.DeadlineExceeded(f"deadline passed before {stage.name}")
                if start_image is not None and stage.supports_init_image:
                    inputs[INIT_IMAGE_INPUT] = start_image
                if tracing.ON and position > 0:
                    _relay_span(self.stages[position - 1], stage, inputs, received.arrived_ns, index)
                # Admission ends once the first stage has every image (a Sleep waits for that).
                first = on_started if position == 0 else None
                received = _Received()
                async for step in self._call(stage, request_id, params, inputs, remaining, first, index, received):
                    yield step
                inputs = received.outputs
                # A denoising stage's step-cache counts are for the result, not the next stage.
                counted = inputs.pop(STEP_CACHE_OUTPUT, None)
                step_cache = counted if counted is not None else step_cache
                latency[str(stage.stage_id)] = (time.perf_counter() - started) * 1e3
            picture = VIDEO_OUTPUT if params.video else "image"
            if picture not in inputs:
                raise errors.StagemeshError(f"the last stage returned no {picture} (outputs: {sorted(inputs)})")
            with tracing.span("encode image", attributes={"stagemesh.output_format": params.output_format}):
                if params.width * params.height <= INLINE_ENCODE_PIXELS and not params.video:
                    result = self._result(request_id, params, index, inputs[picture], latency)
                else:
                    result = await asyncio.to_thread(self._result, request_id, params, index, inputs[picture], latency)
        finally:  # segments no stage or encoder read: a failed or cancelled request's
            shared_tensors.discard([*inputs.values(), *received.outputs.values()])
        if step_cache is not None:
            _report_step_cache(result, step_cache)
        yield result

    async def _call(
        self,
        stage: StageClient,
        request_id: str,
        params: Params,
        inputs: dict,
        remaining: float,
        first: Callable[[], Awaitable[None]] | None,
        index: int,
        received: _Received,
    ) -> AsyncGenerator[DenoisingStep, None]:
        """One stage's Execute: its denoising steps as events, its outputs into `received`."""
        attributes = _call_attributes(stage, request_id, index) if tracing.ON else None
        wire = self._wire_params(stage, params)
        with tracing.span(EXECUTE_METHOD, kind="client", attributes=attributes) as call:
            async for response in stage.execute(
                request_id, wire, inputs, remaining, first, params.num_images, call, self.shared_memory
            ):
                if not response.HasField("progress"):
                    _join_outputs(received.outputs, response.outputs, stage)
                    received.arrived_ns = time.time_ns() if call is not None else 0
                elif stage.kind in DENOISING_KINDS:  # denoising steps, not encoder items
                    yield DenoisingStep(stage.stage_id, response.progress.step, response.progress.total, index)

    @staticmethod
    def _result(request_id: str, params: Params, index: int, image_proto, latency) -> generation_pb2.GenerationResult:
        result = generation_pb2.GenerationResult(
            request_id=request_id,
            output_format=converters.output_format_to_proto(params.output_format),
            width=params.width,
            height=params.height,
            seed=params.seed,
            stage_latency_ms=latency,
            index=index,
        )
        if params.video:
            result.num_frames, result.fps = params.num_frames, params.fps
        if params.output_format == OUTPUT_TENSOR:
            result.tensor.CopyFrom(codec.materialized(image_proto, VIDEO_OUTPUT if params.video else "image"))
        elif params.video:
            frames = codec.to_array(image_proto, VIDEO_OUTPUT)
            data = encode_video(frames, params.output_format, params.fps, params.quality)
            setattr(result, params.output_format, data)
        else:
            data = encode(codec.to_array(image_proto, "image"), params.output_format, params.quality)
            setattr(result, params.output_format, data)  # a format's name is its field of the oneof
        return result

    async def list_stages(self) -> list[gateway_pb2.StageInfo]:
        async def one(stage: StageClient) -> gateway_pb2.StageInfo:
            info = gateway_pb2.StageInfo(stage_id=stage.stage_id, kind=stage.kind, replicas=len(stage.addresses))
            try:
                reply = await stage.describe(DESCRIBE_TIMEOUT_S)
            except errors.StagemeshError:
                info.state = gateway_pb2.STAGE_STATE_UNAVAILABLE
                return info
            info.replicas = stage.replica_count  # a DNS name was resolved by describe()
            info.kind = reply.kind
            info.device = reply.device
            info.device_memory_bytes = reply.device_memory_bytes
            info.sleep_level = reply.sleep_level
            info.workers = reply.workers
            info.supports_sleep = reply.supports_sleep
            info.max_batch_size = reply.max_batch_size
            info.queue_depth = reply.queue_depth
            if reply.batches:
                info.mean_batch_size = reply.batched_requests / reply.batches
            if reply.sleep_level:
                info.state = gateway_pb2.STAGE_STATE_SLEEPING
            else:
                info.state = gateway_pb2.STAGE_STATE_SERVING if reply.ready else gateway_pb2.STAGE_STATE_LOADING
            return info

        return list(await asyncio.gather(*(one(s) for s in self.stages)))


@dataclasses.dataclass
class _Received:
    """A stage's outputs as they arrive, and when the last of them did (traced only)."""

    outputs: dict[str, tensor_pb2.Tensor] = dataclasses.field(default_factory=dict)
    arrived_ns: int = 0


def _join_outputs(outputs: dict[str, tensor_pb2.Tensor], message, stage: StageClient) -> None:
    """Add one outputs message to those received: a large output (a video) comes in several, its
    rows in order (the stage's codec.split_rows)."""
    for name, piece in message.outputs.items():
        try:
            outputs[name] = codec.join_rows(outputs.get(name), piece, f"outputs[{name}]")
        except errors.InvalidArgument as exc:  # the stage's fault, not the caller's
            raise errors.StagemeshError(f"{stage.name} sent outputs that do not fit together: {exc}") from None


def _call_attributes(stage: StageClient, request_id: str, index: int) -> dict[str, object]:
    service, _, method = EXECUTE_METHOD.partition("/")
    return {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": method,
        "server.address": ",".join(stage.addresses),
        "stagemesh.stage.id": stage.stage_id,
        "stagemesh.stage.kind": stage.kind,
        "stagemesh.request_id": request_id,
        "stagemesh.image.index": index,
    }


def _relay_span(source: StageClient, target: StageClient, inputs: dict, arrived_ns: int, index: int) -> None:
    """The gateway's hand-over of one stage's outputs to the next: from their arrival to the next
    call. The bytes then travel in that call (its span, and the stage's `decode inputs`)."""
    tensors = {name: t for name, t in inputs.items() if isinstance(t, tensor_pb2.Tensor)}
    attributes = {
        "stagemesh.relay.from_stage": source.stage_id,
        "stagemesh.relay.to_stage": target.stage_id,
        "stagemesh.relay.tensors": sorted(tensors),
        "stagemesh.relay.bytes": sum(codec.nbytes(t) for t in tensors.values()),
        "stagemesh.relay.shared_memory": any(t.shm_name for t in tensors.values()),
        "stagemesh.image.index": index,
    }
    name = f"relay stage {source.stage_id} -> stage {target.stage_id}"
    tracing.end_span(tracing.start_span(name, attributes=attributes, start_ns=arrived_ns or None))


async def _one(stream: AsyncGenerator[object, None]) -> AsyncIterator[tuple[int, object]]:
    """A single image's events, as `merged` would give them, without its task and queue."""
    async with contextlib.aclosing(stream):
        async for event in stream:
            yield 0, event


def _report_step_cache(result: generation_pb2.GenerationResult, counted: tensor_pb2.Tensor) -> None:
    """The result's step-cache fields from a stage's STEP_CACHE_OUTPUT: [skipped, passes, method]."""
    skipped, passes, method = (int(v) for v in codec.to_array(counted, STEP_CACHE_OUTPUT).reshape(-1)[:3])
    result.step_cache_skipped = skipped
    result.step_cache_passes = passes
    result.step_cache = STEP_CACHES[method] if 0 <= method < len(STEP_CACHES) else ""

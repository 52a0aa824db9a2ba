"""The request path: validate, run stage 0 -> stage N with the deadline passed on at each hop,
turn the last stage's image into the requested format."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from stagemesh.core import codec, converters, errors, logs
from stagemesh.core.params import OUTPUT_PNG, Limits, Params
from stagemesh.gateway.control import Admission
from stagemesh.gateway.images import encode_png
from stagemesh.gateway.stages import StageClient
from stagemesh.v1 import gateway_pb2, generation_pb2

log = logs.get_logger("stagemesh.gateway")

DESCRIBE_TIMEOUT_S = 2.0
NO_DEADLINE_S = 24 * 3600.0
# Below this many pixels a PNG encodes in well under a millisecond: cheaper on the event loop
# than a round trip through a worker thread. Larger images must not block the loop.
INLINE_ENCODE_PIXELS = 64 * 64


@dataclass(frozen=True)
class StageStarted:
    stage_id: int
    kind: str


@dataclass(frozen=True)
class DenoisingStep:
    stage_id: int
    step: int
    total: int


class Pipeline:
    def __init__(self, stages: list[StageClient], admission: Admission):
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        self.stages = stages
        self.admission = admission

    async def wait_until_ready(self, poll_s: float = 0.5) -> None:
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
        """The last stage (the one that draws) sets the image limits; the prompt limit is the tightest."""
        last = self.stages[-1].limits or Limits()
        prompt_bytes = min((s.limits or last).max_prompt_bytes for s in self.stages)
        return Limits(**{**last.__dict__, "max_prompt_bytes": prompt_bytes})

    def resolve(self, params: generation_pb2.GenerationParams) -> Params:
        return converters.params_from_proto(params, self.limits)

    async def generate(self, request_id: str, params: Params, time_remaining: float | None) -> AsyncIterator[object]:
        """Yield StageStarted / DenoisingStep events, then one GenerationResult."""
        deadline = time.monotonic() + (time_remaining if time_remaining is not None else NO_DEADLINE_S)
        ticket = self.admission.enter()  # FAILED_PRECONDITION while paused or a stage sleeps
        try:
            async for event in self._run_stages(request_id, params, deadline, ticket):
                yield event
        finally:
            await ticket.release()

    async def _run_stages(self, request_id: str, params: Params, deadline: float, ticket) -> AsyncIterator[object]:
        wire_params = converters.params_to_proto(params)
        inputs: dict = {}
        latency: dict[str, float] = {}
        for stage in self.stages:
            yield StageStarted(stage.stage_id, stage.kind)
            started = time.perf_counter()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.DeadlineExceeded(f"deadline passed before {stage.name}")
            # Admission ends once the first stage has the request (a Sleep waits for that).
            async for response in stage.execute(request_id, wire_params, inputs, remaining, ticket.release):
                if response.HasField("progress"):
                    if stage.kind in ("diffusion", "denoise"):  # denoising steps, not encoder items
                        yield DenoisingStep(stage.stage_id, response.progress.step, response.progress.total)
                else:
                    inputs = dict(response.outputs.outputs)
            latency[str(stage.stage_id)] = (time.perf_counter() - started) * 1e3
        if "image" not in inputs:
            raise errors.StagemeshError(f"the last stage returned no image (outputs: {sorted(inputs)})")
        if params.width * params.height <= INLINE_ENCODE_PIXELS:
            yield self._result(request_id, params, inputs["image"], latency)
        else:
            yield await asyncio.to_thread(self._result, request_id, params, inputs["image"], latency)

    @staticmethod
    def _result(request_id: str, params: Params, image_proto, latency) -> generation_pb2.GenerationResult:
        result = generation_pb2.GenerationResult(
            request_id=request_id,
            output_format=converters.output_format_enum(params.output_format),
            width=params.width,
            height=params.height,
            seed=params.seed,
            stage_latency_ms=latency,
        )
        if params.output_format == OUTPUT_PNG:
            result.png = encode_png(codec.to_array(image_proto, "image"))
        else:
            result.tensor.CopyFrom(image_proto)
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
            if reply.sleep_level:
                info.state = gateway_pb2.STAGE_STATE_SLEEPING
            else:
                info.state = gateway_pb2.STAGE_STATE_SERVING if reply.ready else gateway_pb2.STAGE_STATE_LOADING
            return info

        return list(await asyncio.gather(*(one(s) for s in self.stages)))

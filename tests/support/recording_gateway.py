"""A real grpc.aio server on port 0 that speaks GatewayService and records what reaches it: every
request message and its metadata, attempt by attempt. For the client's wire tests: fields the
mesh's gateway does not handle yet must still reach the wire, and retries are counted here.

Its methods go through stagemesh.core.rpc.servicer_method like the gateway's, so the statuses,
their google.rpc details and the x-request-id echo are the real ones. It answers with real
images (PIL) of the requested size and format.
"""

from __future__ import annotations

import asyncio
import io
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from PIL import Image

from stagemesh.core import auth, errors, rpc
from stagemesh.gateway.server import CONTROL_METHODS
from stagemesh.v1 import control_pb2, gateway_pb2, gateway_pb2_grpc, generation_pb2, tensor_pb2

F = generation_pb2
_PIL_FORMATS = {F.OUTPUT_FORMAT_JPEG: ("JPEG", "jpeg"), F.OUTPUT_FORMAT_WEBP: ("WEBP", "webp")}
DEFAULT_SIZE = 32


@dataclass
class Attempt:
    method: str
    request: Any
    metadata: dict[str, str]


@dataclass
class Recorder:
    attempts: list[Attempt] = field(default_factory=list)
    # method -> errors to raise, one per attempt, before the method answers normally
    failures: dict[str, list[Exception]] = field(default_factory=lambda: defaultdict(list))
    # method -> coroutine function awaited before each answer (e.g. to outlast a deadline)
    delays: dict[str, Callable[[], Any]] = field(default_factory=dict)

    def of(self, method: str) -> list[Attempt]:
        return [a for a in self.attempts if a.method == method]

    async def enter(self, method: str, request, context) -> None:
        metadata = {k: v if isinstance(v, str) else v.decode() for k, v in context.invocation_metadata() or ()}
        self.attempts.append(Attempt(method, request, metadata))
        if method in self.delays:
            await self.delays[method]()
        if self.failures[method]:
            raise self.failures[method].pop(0)


def _image(params: generation_pb2.GenerationParams, index: int, request_id: str) -> generation_pb2.GenerationResult:
    width = params.width if params.HasField("width") else DEFAULT_SIZE
    height = params.height if params.HasField("height") else DEFAULT_SIZE
    seed = (params.seed if params.HasField("seed") else 7) + index
    pixels = np.random.default_rng(seed).random((height, width, 3), dtype=np.float32)
    fmt = params.output_format or F.OUTPUT_FORMAT_PNG
    result = F.GenerationResult(
        request_id=request_id,
        output_format=fmt,
        width=width,
        height=height,
        seed=seed,
        index=index,
        stage_latency_ms={"0": 1.5, "1": 2.5},
    )
    if fmt == F.OUTPUT_FORMAT_TENSOR:
        result.tensor.CopyFrom(tensor_pb2.Tensor(dtype="float32", shape=[height, width, 3], data=pixels.tobytes()))
        return result
    out = io.BytesIO()
    pil_format, field_name = _PIL_FORMATS.get(fmt, ("PNG", "png"))
    Image.fromarray((pixels * 255).astype(np.uint8)).save(out, format=pil_format)
    setattr(result, field_name, out.getvalue())
    return result


def _count(params: generation_pb2.GenerationParams) -> int:
    return params.num_images if params.HasField("num_images") else 1


class RecordingGateway(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    @rpc.servicer_method
    async def GenerateUnary(self, request, context):
        await self.recorder.enter("GenerateUnary", request, context)
        request_id = rpc.request_id_of(context, request.request_id)
        results = [_image(request.params, i, request_id) for i in range(_count(request.params))]
        return gateway_pb2.GenerateUnaryResponse(result=results[0], results=results)

    @rpc.servicer_method
    async def Generate(self, request, context):
        await self.recorder.enter("Generate", request, context)
        request_id = rpc.request_id_of(context, request.request_id)
        steps = request.params.num_inference_steps if request.params.HasField("num_inference_steps") else 2
        for stage_id, kind in ((0, "ar"), (1, "diffusion")):
            yield gateway_pb2.GenerateResponse(stage_started=gateway_pb2.StageStarted(stage_id=stage_id, kind=kind))
        for index in range(_count(request.params)):
            for step in range(1, steps + 1):
                event = gateway_pb2.DenoisingStep(stage_id=1, step=step, total=steps, index=index)
                yield gateway_pb2.GenerateResponse(denoising_step=event)
            yield gateway_pb2.GenerateResponse(result=_image(request.params, index, request_id))

    @rpc.servicer_method
    async def ListStages(self, request, context):
        await self.recorder.enter("ListStages", request, context)
        return gateway_pb2.ListStagesResponse(
            stages=[
                gateway_pb2.StageInfo(stage_id=0, kind="ar", replicas=1, state=gateway_pb2.STAGE_STATE_SERVING),
                gateway_pb2.StageInfo(
                    stage_id=1, kind="diffusion", replicas=2, state=gateway_pb2.STAGE_STATE_SLEEPING, sleep_level=1
                ),
            ],
            generation_paused=True,
        )

    @rpc.servicer_method
    async def Sleep(self, request, context):
        await self.recorder.enter("Sleep", request, context)
        acks = [
            control_pb2.WorkerAck(
                stage_id=s, rank=0, status=control_pb2.ACK_STATUS_SUCCESS, level=request.level, freed_bytes=2**20
            )
            for s in request.stage_ids
        ]
        return gateway_pb2.SleepResponse(status=control_pb2.CONTROL_STATUS_SUCCESS, acks=acks)

    @rpc.servicer_method
    async def WakeUp(self, request, context):
        await self.recorder.enter("WakeUp", request, context)
        return gateway_pb2.WakeUpResponse(
            status=control_pb2.CONTROL_STATUS_SKIPPED, reason="target stages are not sleeping"
        )

    @rpc.servicer_method
    async def PauseGeneration(self, request, context):
        await self.recorder.enter("PauseGeneration", request, context)
        return gateway_pb2.PauseGenerationResponse()

    @rpc.servicer_method
    async def ResumeGeneration(self, request, context):
        await self.recorder.enter("ResumeGeneration", request, context)
        return gateway_pb2.ResumeGenerationResponse()


class ServerThread:
    """The recording server on its own event loop in a thread, so blocking clients can call it.
    `token`: control calls need it (the gateway's own interceptor). stop() then start() serves
    again on the same port."""

    def __init__(self, recorder: Recorder | None = None, token: str | None = None):
        self.recorder = recorder or Recorder()
        self._token = token
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self.port = 0
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    def start(self) -> None:
        async def start() -> None:
            server = grpc.aio.server(interceptors=auth.interceptors(self._token, CONTROL_METHODS))
            gateway_pb2_grpc.add_GatewayServiceServicer_to_server(RecordingGateway(self.recorder), server)
            self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
            await server.start()
            self._server = server

        self._run(start())

    def stop(self) -> None:
        if self._server is not None:
            self._run(self._server.stop(None))
            self._server = None

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


def unavailable(n: int) -> list[Exception]:
    return [errors.Unavailable(f"stage 1 (diffusion) is unavailable (attempt {i + 1})") for i in range(n)]

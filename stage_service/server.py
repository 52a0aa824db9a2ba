"""The stage's gRPC surface: decode, validate, call the engine, encode. Nothing else."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

import torch

from stagemesh.core import auth, codec, converters, logs, rpc, serve, shared_tensors, startup, tls, tracing
from stagemesh.core.acks import WorkerAck
from stagemesh.core.metrics import ServiceMetrics
from stagemesh.core.params import Limits
from stagemesh.core.rpc import ServiceHost, servicer_method
from stagemesh.stage_service.adapters import StageAdapters
from stagemesh.stage_service.control import Ack, StageControl
from stagemesh.stage_service.engine.dispatch import Engine, OutputsEvent, ProgressEvent
from stagemesh.stage_service.executor import worker_startup
from stagemesh.stage_service.executor.early import EarlyWorkers
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.inputs import check_inputs, init_image
from stagemesh.stage_service.metrics import stage_readings
from stagemesh.stage_service.models.contract import TensorSpec
from stagemesh.stage_service.models.model_dir import prepare_model_dir
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.transport import relay, tensors
from stagemesh.v1 import control_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2

log = logs.get_logger("stagemesh.stage")

_SERVICE = stage_pb2.DESCRIPTOR.services_by_name["StageService"]
SERVICE_NAME = _SERVICE.full_name
# Outputs past this go in several messages (half gRPC's limit here: headroom for the framing).
OUTPUT_MESSAGE_BYTES = rpc.MAX_MESSAGE_BYTES // 2
# With a token, every StageService call needs it, Execute and DescribeStage as much as SleepStage
# and WakeUpStage: only the gateway calls a stage, and it sends the token on each call.
PROTECTED_METHODS = auth.every_method(_SERVICE)


def _acks_proto(stage_id: int, acks: list[Ack]) -> list[control_pb2.WorkerAck]:
    """The workers' answers as the wire carries them, each naming this stage."""
    return [converters.worker_ack_to_proto(WorkerAck(stage_id, **dataclasses.asdict(a))) for a in acks]


def _encode_outputs(
    outputs: dict[str, torch.Tensor], output_format: str, shared_memory: bool = False
) -> list[stage_pb2.StageOutputs]:
    """The outputs as one message, or, where they pass OUTPUT_MESSAGE_BYTES (a video's frames),
    several: each tensor in pieces of whole rows, in order, that the gateway joins
    (codec.join_rows), so no message passes gRPC's size limit. An image or video the gateway will
    encode goes as its uint8 pixels, the bytes the gateway's encoder would make of it: a quarter
    of the float32 bytes to copy, send and parse. With `shared_memory` (the caller is on this
    host), each output of at least shared_tensors.min_bytes() goes whole in a segment of its own."""
    outputs = tensors.encoded_form(outputs, output_format)  # the worker's already, where it ran
    messages: list[stage_pb2.StageOutputs] = []
    size = OUTPUT_MESSAGE_BYTES
    least = shared_tensors.min_bytes() if shared_memory else None
    try:
        for name, tensor in outputs.items():
            nbytes = tensor.numel() * tensor.element_size()
            pieces = _shared_piece(tensor) if least is not None and nbytes and nbytes >= least else None
            if pieces is None:
                pieces = codec.split_rows(tensors.to_proto(tensor), OUTPUT_MESSAGE_BYTES)
            for piece in pieces:
                if not messages or name in messages[-1].outputs or size + len(piece.data) > OUTPUT_MESSAGE_BYTES:
                    messages.append(stage_pb2.StageOutputs())
                    size = 0
                messages[-1].outputs[name].CopyFrom(piece)
                size += len(piece.data)
    except BaseException:
        relay.discard(messages)
        raise
    return messages or [stage_pb2.StageOutputs()]


def _shared_piece(tensor: torch.Tensor) -> list[tensor_pb2.Tensor] | None:
    """The tensor in a segment of its own; None where /dev/shm will not take it (full, or out of
    files): the output then goes inside the messages, as for a caller on another host."""
    try:
        return [tensors.to_shared_proto(tensor, os.getpid())]
    except OSError as exc:
        log.warning("shared memory refused an output; sending it inline", error=str(exc))
        return None


class StageServicer(stage_pb2_grpc.StageServiceServicer):
    def __init__(
        self,
        settings: StageSettings,
        engine: Engine,
        executor: Executor,
        control: StageControl,
        adapters: StageAdapters,
    ):
        self._settings = settings
        self._engine = engine
        self._executor = executor
        self._control = control
        self._adapters = adapters
        self.limits: Limits = settings.limits()
        self.input_specs: dict[str, TensorSpec] | None = None  # what the loaded model takes
        self.ready = False
        self.sent_segments = relay.SentSegments()  # outputs handed over in shared memory

    @servicer_method
    async def Execute(self, request: stage_pb2.ExecuteRequest, context) -> Any:
        request_id = logs.current_request_id()
        check_inputs(request.inputs, self.input_specs)
        image = init_image(request.inputs, self.limits.supports_init_image)
        params = converters.params_from_proto(request.params, self.limits, image)
        self._adapters.check(params)
        with tracing.span("decode inputs"):
            inputs = {name: tensors.from_proto(t, f"inputs[{name}]") for name, t in request.inputs.items()}
        explicit_steps = request.params.HasField("num_inference_steps")
        # Asked by a caller on another host (a gateway misconfigured), the outputs go inline.
        shared = request.outputs_in_shared_memory and shared_tensors.local_peer(context.peer())
        images = rpc.images_hint(context)
        async for event in self._engine.run(request_id, params, inputs, explicit_steps, images):
            if isinstance(event, ProgressEvent):
                yield stage_pb2.ExecuteResponse(progress=stage_pb2.StageProgress(step=event.step, total=event.total))
            elif isinstance(event, OutputsEvent):
                with tracing.span("encode outputs"):
                    messages = await relay.encoded(_encode_outputs, event.outputs, params.output_format, shared)
                self.sent_segments.sent(relay.names_in(messages))
                try:
                    for message in messages:
                        yield stage_pb2.ExecuteResponse(outputs=message)
                except BaseException:  # the caller went away: what it did not read, no one will
                    relay.discard(messages)
                    raise

    @servicer_method
    async def DescribeStage(self, request, context) -> stage_pb2.DescribeStageResponse:
        s, lim = self._settings, self.limits
        ready = self._executor.ready_info()
        return stage_pb2.DescribeStageResponse(
            stage_id=s.stage_id,
            kind=s.kind,
            ready=self.ready and self._engine.serving,
            limits=converters.limits_to_proto(lim),
            device=ready[0].device if ready else s.device,
            device_memory_bytes=self._executor.device_memory_bytes(),
            workers=s.worker_processes(),
            max_batch_size=s.max_batch_size,
            supports_sleep=self._control.supports_sleep,
            sleep_level=self._control.level,
            supports_negative_prompt=lim.supports_negative_prompt,
            supports_init_image=lim.supports_init_image,
            queue_depth=self._engine.queue_depth,
            batches=self._engine.batches,
            batched_requests=self._engine.batched_requests,
            supports_adapters=lim.supports_adapters,
        )

    @servicer_method
    async def SleepStage(self, request: stage_pb2.SleepStageRequest, context) -> stage_pb2.SleepStageResponse:
        acks = await self._control.sleep(request.level)
        return stage_pb2.SleepStageResponse(acks=_acks_proto(self._settings.stage_id, acks))

    @servicer_method
    async def WakeUpStage(self, request, context) -> stage_pb2.WakeUpStageResponse:
        acks = await self._control.wake()
        return stage_pb2.WakeUpStageResponse(acks=_acks_proto(self._settings.stage_id, acks))

    @servicer_method
    async def LoadStageAdapter(
        self, request: control_pb2.LoadAdapterRequest, context
    ) -> control_pb2.LoadAdapterResponse:
        infos = await self._adapters.load(request.name, request.path)
        return control_pb2.LoadAdapterResponse(adapters=[converters.adapter_info_to_proto(i) for i in infos])

    @servicer_method
    async def UnloadStageAdapter(
        self, request: control_pb2.UnloadAdapterRequest, context
    ) -> control_pb2.UnloadAdapterResponse:
        dropped = await self._adapters.unload(request.name)
        return control_pb2.UnloadAdapterResponse(stage_ids=[self._settings.stage_id] if dropped else [])

    @servicer_method
    async def ListStageAdapters(self, request, context) -> control_pb2.ListAdaptersResponse:
        infos = await self._adapters.list_all()
        return control_pb2.ListAdaptersResponse(adapters=[converters.adapter_info_to_proto(i) for i in infos])


async def serve_stage(settings: StageSettings, early: EarlyWorkers | None = None) -> None:
    """`early`: the workers stage_service/entry.py spawned, the model folder checked; without
    them the stage checks its folder and spawns its workers once it listens."""
    tracing.configure(f"stagemesh-stage-{settings.stage_id}")  # before the server: its interceptors follow it
    token = auth.load_token(settings.token_file or None)
    metrics = ServiceMetrics(f"stage-{settings.stage_id}", settings.host, settings.metrics_port)
    # Metrics first: they also count the calls the auth interceptor refuses.
    host = ServiceHost(
        settings.host,
        settings.port,
        [SERVICE_NAME],
        interceptors=[*metrics.interceptors(), *auth.interceptors(token, PROTECTED_METHODS)],
        credentials=tls.server_credentials(settings.tls_cert, settings.tls_key),
        health_port=settings.health_port,
    )
    worker_startup.export_cache_security(token, settings.tls_ca)  # again, for a stage started here
    loop = asyncio.get_running_loop()

    def on_health(serving: bool) -> None:
        loop.create_task(host.set_serving(serving))

    spawned = early.take() if early is not None else None
    executor = Executor(settings, on_death=lambda group, why: engine.worker_died(group, why), spawned=spawned)
    engine = Engine(
        executor, settings.kind, settings.max_batch_size, settings.max_queue, on_health, settings.batch_invariant
    )
    control = StageControl(executor.stage_name, engine, executor, settings.enable_sleep)
    adapters = StageAdapters(executor.stage_name, engine, executor, sleep_level=lambda: control.level)
    servicer = StageServicer(settings, engine, executor, control, adapters)
    stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, host.server)
    metrics.add_readings(stage_readings(engine, executor, control, lambda: servicer.ready and engine.serving))

    async def load() -> None:
        if early is None:
            with startup.phase("model folder"):
                await asyncio.to_thread(prepare_model_dir, settings)
        # From the spawn: with early workers, from before the stage's own imports.
        with startup.phase("workers", since=early.at if early is not None else None):
            readies = await asyncio.to_thread(executor.start)
        ready = readies[0]
        startup.add(list(ready.phases))
        servicer.limits = dataclasses.replace(
            settings.limits(ready.limits),
            supports_negative_prompt=ready.supports_negative_prompt,
            supports_init_image=ready.supports_init_image,
            supports_adapters=ready.adapters is not None,
        )
        adapters.start(None if ready.adapters is None else list(ready.adapters))
        servicer.input_specs = ready.input_specs
        engine.start()
        servicer.ready = True
        startup.report(stage_id=settings.stage_id, kind=settings.kind)

    async def close() -> None:
        await engine.close()
        servicer.sent_segments.drop_all()
        await asyncio.to_thread(executor.shutdown)

    await serve.run(host, ready_file=settings.ready_file, load=load, close=close, metrics=metrics)

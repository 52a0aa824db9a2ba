"""The gateway's gRPC surface: thin methods over gateway.pipeline.Pipeline."""

from __future__ import annotations

import argparse
import asyncio

from stagemesh.core import auth, converters, errors, logs, rpc, serve, tls, tracing
from stagemesh.core.metrics import ServiceMetrics
from stagemesh.core.params import check_request_id
from stagemesh.core.rpc import ServiceHost, servicer_method
from stagemesh.gateway.adapters import AdapterControl
from stagemesh.gateway.control import Admission, ControlPlane
from stagemesh.gateway.delivery import DeliveryBudget, result_bytes
from stagemesh.gateway.metrics import gateway_readings
from stagemesh.gateway.pipeline import DenoisingStep, Pipeline, StageStarted
from stagemesh.gateway.settings import DEFAULT_RESULT_CHUNK_BYTES, GatewaySettings
from stagemesh.gateway.stages import StageClient
from stagemesh.gateway.watch import SleepWatch, StageWatch
from stagemesh.v1 import control_pb2, gateway_pb2, gateway_pb2_grpc, generation_pb2

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
# Need the bearer token when one is configured.
CONTROL_METHODS = auth.control_methods(
    SERVICE_NAME,
    (
        "Sleep",
        "WakeUp",
        "PauseGeneration",
        "ResumeGeneration",
        "LoadAdapter",
        "UnloadAdapter",
        "ListAdapters",
    ),
)
# Need the API key (or the control token) when a key is configured.
DATA_METHODS = auth.control_methods(SERVICE_NAME, ("Generate", "GenerateUnary", "ListStages"))


def _event_protos(event: object, chunk_bytes: int) -> list[gateway_pb2.GenerateResponse]:
    if isinstance(event, StageStarted | DenoisingStep):
        return [converters.progress_to_proto(event)]
    assert isinstance(event, generation_pb2.GenerationResult)
    return converters.result_to_events(event, chunk_bytes)


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(
        self,
        pipeline: Pipeline,
        control: ControlPlane,
        delivery: DeliveryBudget,
        adapters: AdapterControl,
        result_chunk_bytes: int = DEFAULT_RESULT_CHUNK_BYTES,
    ):
        self._pipeline = pipeline
        self._control = control
        self._delivery = delivery
        self._adapters = adapters
        self._chunk_bytes = result_chunk_bytes

    def _start(self, request, context):
        check_request_id(request.request_id)
        return logs.current_request_id(), self._pipeline.resolve(request.params)

    @servicer_method
    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        request_id, params = self._start(request, context)
        async for event in self._pipeline.generate(request_id, params, context.time_remaining()):
            if isinstance(event, generation_pb2.GenerationResult):
                self._delivery.take(result_bytes(event), context)
            for message in _event_protos(event, self._chunk_bytes):
                yield message

    @servicer_method
    async def GenerateUnary(self, request: gateway_pb2.GenerateUnaryRequest, context):
        request_id, params = self._start(request, context)
        results = []
        async for event in self._pipeline.generate(request_id, params, context.time_remaining()):
            if isinstance(event, generation_pb2.GenerationResult):
                counted = result_bytes(event)
                self._delivery.take(counted, context)
                results.append((event.index, counted, event))
        if len(results) != params.num_images:
            raise AssertionError(f"pipeline ended with {len(results)} of {params.num_images} results")
        results.sort(key=lambda r: r[0])
        size = results[0][1] + sum(counted for _, counted, _ in results)  # `result` repeats results[0]
        if size > rpc.MAX_MESSAGE_BYTES:
            raise errors.ResourceExhausted(
                f"the results are about {size} bytes, past the {rpc.MAX_MESSAGE_BYTES} one message may hold; "
                "call Generate, which sends a large result in chunks (or ask for fewer frames or a smaller size)"
            )
        # Built by reference and copy, not by keyword: the constructor copies each result again.
        reply = gateway_pb2.GenerateUnaryResponse()
        reply.results.extend(r for _, _, r in results)
        reply.result.CopyFrom(results[0][2])
        return reply

    @servicer_method
    async def ListStages(self, request, context) -> gateway_pb2.ListStagesResponse:
        return gateway_pb2.ListStagesResponse(
            stages=await self._pipeline.list_stages(), generation_paused=self._pipeline.admission.paused
        )

    @servicer_method
    async def Sleep(self, request: gateway_pb2.SleepRequest, context) -> gateway_pb2.SleepResponse:
        level = request.level if request.HasField("level") else None
        result = await self._control.sleep(list(request.stage_ids), level, context.time_remaining())
        return gateway_pb2.SleepResponse(status=result.status, acks=result.acks)

    @servicer_method
    async def WakeUp(self, request: gateway_pb2.WakeUpRequest, context) -> gateway_pb2.WakeUpResponse:
        result = await self._control.wake(list(request.stage_ids), context.time_remaining())
        return gateway_pb2.WakeUpResponse(status=result.status, reason=result.reason, acks=result.acks)

    @servicer_method
    async def PauseGeneration(self, request, context) -> gateway_pb2.PauseGenerationResponse:
        await self._control.pause()
        return gateway_pb2.PauseGenerationResponse()

    @servicer_method
    async def ResumeGeneration(self, request, context) -> gateway_pb2.ResumeGenerationResponse:
        self._control.resume()
        return gateway_pb2.ResumeGenerationResponse()

    @servicer_method
    async def LoadAdapter(self, request: control_pb2.LoadAdapterRequest, context) -> control_pb2.LoadAdapterResponse:
        infos = await self._adapters.load(request.name, request.path, context.time_remaining())
        return control_pb2.LoadAdapterResponse(adapters=[converters.adapter_info_to_proto(i) for i in infos])

    @servicer_method
    async def UnloadAdapter(
        self, request: control_pb2.UnloadAdapterRequest, context
    ) -> control_pb2.UnloadAdapterResponse:
        return control_pb2.UnloadAdapterResponse(
            stage_ids=await self._adapters.unload(request.name, context.time_remaining())
        )

    @servicer_method
    async def ListAdapters(self, request, context) -> control_pb2.ListAdaptersResponse:
        infos = await self._adapters.list_all(context.time_remaining())
        return control_pb2.ListAdaptersResponse(adapters=[converters.adapter_info_to_proto(i) for i in infos])


async def serve_gateway(settings: GatewaySettings) -> None:
    if not settings.stage:
        raise errors.InvalidArgument.field("--stage", "give at least one stage ADDRESS")
    tracing.configure("stagemesh-gateway")  # before the server: its interceptors follow it
    token = auth.load_token(settings.token_file)
    api_key = auth.load_api_key(settings.api_key_file)
    credentials = tls.server_credentials(settings.tls_cert, settings.tls_key)
    stages = [
        StageClient(i, [a.strip() for a in spec.split(",") if a.strip()], tls_ca=settings.tls_ca, token=token)
        for i, spec in enumerate(settings.stage)
    ]
    admission = Admission()
    pipeline = Pipeline(stages, admission, settings.max_images_per_request, settings.shared_memory)
    control = ControlPlane(stages, admission)
    adapters = AdapterControl(stages)
    metrics = ServiceMetrics("gateway", settings.host, settings.metrics_port)
    metrics.add_readings(gateway_readings(admission, len(stages)))
    # Metrics first: they also count the calls the auth interceptor refuses.
    host = ServiceHost(
        settings.host,
        settings.port,
        [SERVICE_NAME],
        max_receive_bytes=settings.max_request_bytes,
        interceptors=[
            *metrics.interceptors(),
            *auth.interceptors(token, CONTROL_METHODS),
            *auth.api_key_interceptors(api_key, DATA_METHODS, token),
        ],
        credentials=credentials,
        health_port=settings.health_port,
    )
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
        GatewayServicer(
            pipeline,
            control,
            DeliveryBudget(settings.max_undelivered_bytes),
            adapters,
            settings.result_chunk_bytes,
        ),
        host.server,
    )

    http = _http_listener(settings, pipeline, control, adapters, token, api_key)
    watching: list[asyncio.Task] = []

    async def load() -> None:
        if http is not None:
            http.start()  # answers while the stages load: /health says 503 until they serve
        await pipeline.wait_until_ready()
        control.restore()
        watching.append(asyncio.ensure_future(StageWatch(stages, settings.stage_unresponsive_s).run()))
        watching.append(asyncio.ensure_future(SleepWatch(stages, control).run()))

    async def close() -> None:
        for task in watching:
            task.cancel()
        await asyncio.gather(*watching, return_exceptions=True)
        await asyncio.gather(*(s.close() for s in stages))

    await serve.run(
        host,
        ready_file=settings.ready_file,
        load=load,
        close=close,
        metrics=metrics,
        ready_info={"http": http.address} if http is not None else None,
        stop_listeners=http.stop if http is not None else None,
    )


def _http_listener(
    settings: GatewaySettings, pipeline: Pipeline, control: ControlPlane, adapters: AdapterControl, token, api_key
):
    """The HTTP API's listener, bound; None without --http-port (FastAPI is then never imported)."""
    if settings.http_port is None:
        return None
    from stagemesh.gateway.http.app import HttpSettings, create_app
    from stagemesh.gateway.http.listener import HttpListener

    http = HttpSettings(
        settings.max_request_bytes,
        control_token=token,
        api_key=api_key,
        max_video_jobs=settings.max_video_jobs,
        video_job_timeout_s=settings.video_job_timeout_s,
        video_retention_s=settings.video_retention_s,
    )
    return HttpListener(
        create_app(pipeline, control, http, adapters),
        settings.host,
        settings.http_port,
        tls_cert=settings.tls_cert,
        tls_key=settings.tls_key,
        grace_s=serve.STOP_GRACE_S,
    )


def main(args: argparse.Namespace) -> None:
    logs.configure("gateway", args.log_level)
    serve.main("gateway", _serve(args))


async def _serve(args: argparse.Namespace) -> None:
    # The settings are built inside the run, so a value out of range ends the start as every
    # refused option does: exit 2 and one log line naming the flag.
    await serve_gateway(GatewaySettings.from_args(args))

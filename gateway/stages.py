"""Clients for the stage services: one channel per stage, replicas balanced by gRPC's round_robin."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from stagemesh import auth, errors, rpc, tls
from stagemesh.params import Limits
from stagemesh.v1 import generation_pb2, stage_pb2, stage_pb2_grpc

_ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


def channel_target(addresses: list[str]) -> str:
    """One gRPC target for a stage: `dns:///name:port`, a single address, or an ipv4/ipv6 list."""
    if len(addresses) == 1:
        return addresses[0]
    if all(a.startswith("[") for a in addresses):
        return "ipv6:" + ",".join(addresses)
    return "ipv4:" + ",".join(addresses)


def limits_from_proto(msg: stage_pb2.StageLimits) -> Limits:
    return Limits(
        pixel_multiple=msg.pixel_multiple, max_pixels_side=msg.max_pixels_side,
        max_inference_steps=msg.max_inference_steps, max_prompt_bytes=msg.max_prompt_bytes,
        default_size=msg.default_size, default_inference_steps=msg.default_inference_steps,
        default_guidance_scale=msg.default_guidance_scale, max_guidance_scale=msg.max_guidance_scale,
    )


@dataclass
class StageClient:
    stage_id: int
    addresses: list[str]
    kind: str = ""
    limits: Limits | None = None
    supports_sleep: bool = False
    sleep_level: int = 0
    tls_ca: str | None = None  # CA bundle verifying the stage's certificate; None: plaintext
    token: str | None = field(default=None, repr=False)  # sent on SleepStage/WakeUpStage

    def __post_init__(self) -> None:
        options = [*rpc.channel_options(), ("grpc.service_config", _ROUND_ROBIN)]
        if self.tls_ca and len(self.addresses) > 1:
            # An ipv4:/ipv6: list is no host name; verify the replicas' certificates against the first host.
            options.append(("grpc.ssl_target_name_override", self.addresses[0].rsplit(":", 1)[0].strip("[]")))
        self._channel = tls.channel(channel_target(self.addresses), self.tls_ca, options, aio=True)
        self._control_metadata = auth.bearer_metadata(self.token)
        self._stub = stage_pb2_grpc.StageServiceStub(self._channel)

    @property
    def name(self) -> str:
        return f"stage {self.stage_id} ({self.kind or 'unknown kind'})"

    async def close(self) -> None:
        await self._channel.close()

    async def _unary(self, method, request, **kwargs):
        try:
            return await method(request, **kwargs)
        except grpc.aio.AioRpcError as exc:
            raise self._domain_error(exc) from None

    async def describe(self, timeout: float, wait_for_ready: bool = False) -> stage_pb2.DescribeStageResponse:
        reply = await self._unary(self._stub.DescribeStage, stage_pb2.DescribeStageRequest(),
                                  timeout=timeout, wait_for_ready=wait_for_ready)
        self.kind = reply.kind
        self.limits = limits_from_proto(reply.limits)
        self.supports_sleep = reply.supports_sleep
        self.sleep_level = reply.sleep_level
        return reply

    async def sleep(self, level: int, timeout: float | None) -> list:
        reply = await self._unary(self._stub.SleepStage, stage_pb2.SleepStageRequest(level=level), timeout=timeout,
                                  metadata=self._control_metadata)
        return list(reply.acks)

    async def wake(self, timeout: float | None) -> list:
        reply = await self._unary(self._stub.WakeUpStage, stage_pb2.WakeUpStageRequest(), timeout=timeout,
                                  metadata=self._control_metadata)
        return list(reply.acks)

    async def execute(self, request_id: str, params: generation_pb2.GenerationParams, inputs,
                      timeout: float, on_started=None) -> AsyncIterator[stage_pb2.ExecuteResponse]:
        """Stream one request through the stage; `on_started` is awaited once the stage answered."""
        request = stage_pb2.ExecuteRequest(request_id=request_id, params=params, inputs=inputs)
        call = self._stub.Execute(request, timeout=timeout, metadata=rpc.outgoing_metadata(request_id))
        try:
            async for response in call:
                if on_started is not None:
                    await on_started()
                    on_started = None
                yield response
        except grpc.aio.AioRpcError as exc:
            raise self._domain_error(exc) from None
        finally:
            call.cancel()  # no-op when finished; frees the stage's slot when we stop early

    def _domain_error(self, exc: grpc.aio.AioRpcError) -> errors.StagemeshError:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            return errors.Unavailable(f"{self.name} is unavailable: {exc.details()}")
        if code == grpc.StatusCode.CANCELLED:
            return errors.Cancelled(f"{self.name}: {exc.details()}")
        # Pass the stage's status through unchanged, rich details included.
        trailing = [(k, v) for k, v in (exc.trailing_metadata() or ()) if k == _STATUS_DETAILS_KEY]
        return errors.UpstreamError(code, exc.details() or "", trailing)

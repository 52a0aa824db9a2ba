"""The request messages both clients send and what they make of the replies."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from stagemesh.client.errors import InternalError
from stagemesh.client.results import GenerationResult, ProgressEvent, event_from_proto
from stagemesh.core.converters import ResultAssembler
from stagemesh.v1 import gateway_pb2, generation_pb2


def unary_request(params: generation_pb2.GenerationParams, request_id: str | None) -> gateway_pb2.GenerateUnaryRequest:
    return gateway_pb2.GenerateUnaryRequest(params=params, request_id=request_id or "")


def stream_request(params: generation_pb2.GenerationParams, request_id: str | None) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(params=params, request_id=request_id or "")


def sleep_request(stage_ids: Iterable[int], level: int) -> gateway_pb2.SleepRequest:
    return gateway_pb2.SleepRequest(stage_ids=list(stage_ids), level=level)


def wake_request(stage_ids: Iterable[int]) -> gateway_pb2.WakeUpRequest:
    return gateway_pb2.WakeUpRequest(stage_ids=list(stage_ids))


def unary_results(reply: gateway_pb2.GenerateUnaryResponse) -> list[GenerationResult]:
    """Every image of a GenerateUnary answer, by index (a gateway without num_images sends one)."""
    messages = list(reply.results) or [reply.result]
    return sorted((GenerationResult.from_proto(m) for m in messages), key=lambda r: r.index)


class Collected:
    """The results among a Generate stream's events, as they pass to on_progress."""

    def __init__(self) -> None:
        self._results: list[GenerationResult] = []
        self._assembler = ResultAssembler()

    def add(self, message: gateway_pb2.GenerateResponse) -> ProgressEvent | None:
        """The event `message` carries; None for a piece of a large result (its result event,
        which follows the pieces, carries the whole)."""
        if message.HasField("result_chunk"):
            self._assembler.add_chunk(message.result_chunk)
            return None
        if message.HasField("result"):
            message = gateway_pb2.GenerateResponse(result=self._assembler.complete(message.result))
        event = event_from_proto(message)
        if isinstance(event, GenerationResult):
            self._results.append(event)
        return event

    def results(self) -> list[GenerationResult]:
        if not self._results:
            raise InternalError(grpc.StatusCode.INTERNAL, "the gateway's Generate stream ended without a result")
        return sorted(self._results, key=lambda r: r.index)

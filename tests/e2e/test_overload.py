"""A burst far beyond what the stages can queue: every call is answered, and an overloaded mesh
says so with RESOURCE_EXHAUSTED (or UNAVAILABLE), never CANCELLED before any handler ran."""

from __future__ import annotations

import collections
import time

import grpc
import pytest

from stagemesh.v1 import gateway_pb2, generation_pb2

pytestmark = pytest.mark.mesh

BURST = 2000
TINY = generation_pb2.GenerationParams(prompt="a burst", width=16, height=16, num_inference_steps=1, seed=1)


def test_a_burst_of_unary_calls_is_answered_ok_or_overloaded_never_cancelled(mesh):
    with mesh.channel() as channel:
        stub = mesh.gateway(channel)
        started = time.monotonic()
        calls = [
            stub.GenerateUnary.future(gateway_pb2.GenerateUnaryRequest(params=TINY), timeout=120) for _ in range(BURST)
        ]
        sent_in = time.monotonic() - started
        codes: collections.Counter[grpc.StatusCode] = collections.Counter()
        for call in calls:
            try:
                call.result(timeout=180)
                codes[grpc.StatusCode.OK] += 1
            except grpc.RpcError as exc:
                codes[exc.code()] += 1
    assert sum(codes.values()) == BURST
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}, (
        codes,
        sent_in,
    )
    assert codes[grpc.StatusCode.OK] > 0, codes

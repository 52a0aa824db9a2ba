"""Requests at the wire's edges against a real mesh (`stagemesh up`): bytes that are no request
message are INVALID_ARGUMENT on every service, and a burst of calls is answered, never CANCELLED
by the server."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import start_mesh, write_config

pytestmark = pytest.mark.mesh

RPC_TIMEOUT_S = 60.0
TRUNCATED = b"\x0a\x05\x0a"  # field 1, length 5, one byte follows
NOT_UTF8_PROMPT = b"\x0a\x03\x0a\x01\xff"  # params { prompt: 0xff }
NOT_UTF8_REQUEST_ID = b"\x0a\x01\xff"  # request_id: 0xff
# (service, method, streaming reply, payload)
CASES = [
    ("gateway", "/stagemesh.v1.GatewayService/GenerateUnary", False, NOT_UTF8_PROMPT),
    ("gateway", "/stagemesh.v1.GatewayService/Generate", True, NOT_UTF8_PROMPT),
    ("gateway", "/stagemesh.v1.GatewayService/Sleep", False, TRUNCATED),
    ("stage-0", "/stagemesh.v1.StageService/Execute", True, NOT_UTF8_REQUEST_ID),
    ("stage-1", "/stagemesh.v1.StageService/DescribeStage", False, TRUNCATED),
    ("cache", "/stagemesh.v1.CacheService/Evict", False, TRUNCATED),
    ("cache", "/stagemesh.v1.CacheService/PublishSession", "bidi", TRUNCATED),
]


@pytest.fixture(scope="module")
def wire_mesh(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("robust-wire")
    mesh = start_mesh(write_config(root / "mesh.toml", model_dir), root / "mesh.log")
    yield mesh
    assert mesh.stop() == 0, mesh.logs()[-3000:]
    assert "Traceback" not in mesh.logs()


def _raw_call(channel: grpc.Channel, method: str, streaming, payload: bytes):
    if streaming == "bidi":
        return list(channel.stream_stream(method)(iter([payload]), timeout=10))
    if streaming:
        return list(channel.unary_stream(method)(payload, timeout=10))
    return channel.unary_unary(method)(payload, timeout=10)


@pytest.mark.parametrize("service,method,streaming,payload", CASES, ids=[c[1].rsplit("/", 1)[1] for c in CASES])
def test_bytes_that_do_not_parse_are_invalid_argument(wire_mesh, service, method, streaming, payload):
    address = wire_mesh.address if service == "gateway" else wire_mesh.child_addresses()[service]
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _raw_call(channel, method, streaming, payload)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
        assert "does not parse" in info.value.details(), info.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with wire_mesh.channel() as channel:
        params = generation_pb2.GenerationParams(prompt="after", width=16, height=16, num_inference_steps=1)
        reply = wire_mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=60)
        assert reply.result.png.startswith(b"\x89PNG")

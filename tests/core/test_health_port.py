"""--health-port: a service serving TLS also answers grpc.health.v1, and nothing else, in plaintext
on a port of its own, with the same statuses as its TLS port (what the kubelet's gRPC probes,
which cannot speak TLS, ask; deploy/kubernetes/overlays/tls)."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.core import readyfile, tls
from stagemesh.v1 import cache_pb2, cache_pb2_grpc
from tests.core.test_security import make_certificates
from tests.support.meshproc import spawn_service

SERVING = health_pb2.HealthCheckResponse.SERVING
RPC_TIMEOUT_S = 60.0


@pytest.fixture
def tls_cache(tmp_path):
    pki = make_certificates(tmp_path)
    args = ["cache", f"--root={tmp_path / 'root'}", f"--tls-cert={pki['cert']}", f"--tls-key={pki['key']}"]
    cache = spawn_service("cache", [*args, "--health-port=0"], tmp_path)
    try:
        address = cache.wait_bound()
        info = readyfile.read(cache.ready_path)
        assert info is not None
        yield address, info["health"], str(pki["ca"])
    finally:
        assert cache.stop() == 0, cache.logs()[-3000:]


def test_the_health_port_answers_health_alone_in_plaintext(tls_cache):
    address, health_address, ca = tls_cache
    assert health_address != address
    with grpc.insecure_channel(health_address) as plain:
        health = health_pb2_grpc.HealthStub(plain)
        request = health_pb2.HealthCheckRequest()
        # Bound is not yet serving: the port answers NOT_SERVING until the service is up, which
        # on a loaded machine outlasts the first check.
        deadline = time.monotonic() + RPC_TIMEOUT_S
        while (status := health.Check(request, timeout=RPC_TIMEOUT_S, wait_for_ready=True).status) != SERVING:
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        named = health_pb2.HealthCheckRequest(service="stagemesh.v1.CacheService")
        assert health.Check(named, timeout=RPC_TIMEOUT_S).status == SERVING
        with pytest.raises(grpc.RpcError) as refused:  # the service itself is on the TLS port only
            cache_pb2_grpc.CacheServiceStub(plain).GetStats(cache_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with tls.channel(address, ca) as secure:
        stats = cache_pb2_grpc.CacheServiceStub(secure).GetStats(cache_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)
        assert stats.root
    with grpc.insecure_channel(address) as plain, pytest.raises(grpc.RpcError):  # no plaintext on the TLS port
        health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)


@pytest.mark.parametrize("value", ["-1", "65536", "http"])
def test_a_bad_health_port_is_refused(value):
    from stagemesh.cli import _parser

    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["gateway", "--health-port", value])
    assert exited.value.code == 2

"""The gateway's DNS lookups for `dns://SERVER/name:port` stage targets, against a DNS server of
the test's own (tests/support/dns_stub.py), and gRPC's resolver asking that same server."""

from __future__ import annotations

import asyncio
import socket
import struct
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stagemesh.core import errors
from stagemesh.gateway import dns
from stagemesh.gateway.stages import DnsTarget, StageClient, dns_target, resolve
from tests.support.dns_stub import DnsStub


@pytest.fixture
def stub():
    with DnsStub({"stage-1.mesh.test": ["127.0.0.2", "127.0.0.3", "fd00::11"]}) as server:
        yield server


def server_of(stub: DnsStub) -> tuple[str, int]:
    host, port = stub.address.rsplit(":", 1)
    return host, int(port)


def test_lookup_gives_the_ipv4_then_the_ipv6_addresses(stub):
    assert asyncio.run(dns.lookup("stage-1.mesh.test", server_of(stub))) == ["127.0.0.2", "127.0.0.3", "fd00::11"]
    assert stub.queries["stage-1.mesh.test", 1] == stub.queries["stage-1.mesh.test", 28] == 1


def test_a_resolved_target_gives_replica_addresses(stub):
    target = dns_target(stub.target("stage-1.mesh.test", 50062))
    assert target == DnsTarget("stage-1.mesh.test", 50062, server_of(stub))
    assert asyncio.run(resolve(target)) == ["127.0.0.2:50062", "127.0.0.3:50062", "[fd00::11]:50062"]


def test_failures_say_why(stub, monkeypatch):
    with pytest.raises(dns.DnsError, match="no such name"):
        asyncio.run(dns.lookup("other.mesh.test", server_of(stub)))
    stub.set("empty.mesh.test", [])
    with pytest.raises(dns.DnsError, match="has no address for it"):
        asyncio.run(dns.lookup("empty.mesh.test", server_of(stub)))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # bound, never answers
        silent.bind(("127.0.0.1", 0))
        monkeypatch.setattr(dns, "QUERY_TIMEOUT_S", 0.05)
        closed = silent.getsockname()
        with pytest.raises(dns.DnsError, match="no answer from the DNS server"):
            asyncio.run(dns.lookup("stage-1.mesh.test", closed))
    # the same port, now closed: the kernel answers with ICMP port unreachable
    with pytest.raises(dns.DnsError, match="nothing answers DNS at 127.0.0.1"):
        asyncio.run(dns.lookup("stage-1.mesh.test", closed))


def test_a_truncated_or_foreign_answer_is_refused():
    header = struct.pack(">HHHHHH", 7, 0x8000 | 0x0200, 0, 0, 0, 0)
    with pytest.raises(dns.DnsError, match="does not fit one datagram"):
        dns.addresses(header, 7, 1, "many.mesh.test")
    with pytest.raises(dns.DnsError, match="not to the query sent"):
        dns.addresses(header, 8, 1, "many.mesh.test")
    with pytest.raises(dns.DnsError, match="malformed"):
        dns.addresses(struct.pack(">HHHHHH", 7, 0x8000, 1, 1, 0, 0) + b"\x05ab", 7, 1, "many.mesh.test")


@pytest.mark.parametrize(
    "authority, expected",
    [("10.0.0.2:5353", ("10.0.0.2", 5353)), ("10.0.0.2", ("10.0.0.2", 53)), ("[fd00::1]:53", ("fd00::1", 53))],
)
def test_the_server_is_an_ip_address(authority, expected):
    assert dns.server_address(authority) == expected


def test_a_server_named_by_host_name_is_refused_naming_the_flag():
    with pytest.raises(errors.InvalidArgument, match="the DNS server must be IP") as refused:
        dns_target("dns://resolver.internal/stage-1.mesh.test:50062")
    assert refused.value.violations[0].field == "--stage"


def test_grpc_resolves_through_the_same_server(stub):
    """The premise of honouring SERVER: gRPC's resolver (c-ares) sends its queries there too."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.2:0")
    server.start()
    try:
        with grpc.insecure_channel(stub.target("stage-1.mesh.test", port)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.queries["stage-1.mesh.test", 1] >= 1
    finally:
        server.stop(None)


def test_a_dns_stage_counts_the_replicas_its_name_resolves_to(stub):
    async def scenario() -> tuple[int, int, int]:
        stage = StageClient(stage_id=1, addresses=[stub.target("stage-1.mesh.test", 50062)])
        before = stage.replica_count
        await stage._replica_stubs()  # what describe(), sleep() and wake() do first
        three = stage.replica_count
        stub.set("stage-1.mesh.test", ["127.0.0.2"])  # a replica left: its channel closes
        await stage._replica_stubs()
        after = stage.replica_count
        await stage.close()
        return before, three, after

    assert asyncio.run(scenario()) == (1, 3, 1)

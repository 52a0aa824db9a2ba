"""Two "nodes" on one machine, as docs/DEPLOY.md ("A two-node rehearsal") describes: each node is a
loopback address (127.0.0.2, 127.0.0.3) with its own cache service and a replica of the diffusion
stage on the same port; the gateway reaches both replicas through one DNS name, served by a DNS
server of the test's own (tests/support/dns_stub.py) that gRPC's resolver and the gateway's
control calls both ask. Requests spread over both replicas; one replica killed (SIGKILL), requests
keep succeeding on the other; restarted, it is used again. The AR stage is the session mesh's."""

from __future__ import annotations

import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.core import readyfile, rpc
from stagemesh.v1 import cache_pb2, cache_pb2_grpc, gateway_pb2, gateway_pb2_grpc, generation_pb2
from tests.support.dns_stub import DnsStub
from tests.support.meshproc import START_TIMEOUT_S, Service, alive, descendants, segments_of, shm_entries, spawn_service

pytestmark = [pytest.mark.mesh, pytest.mark.timeout(300)]

NODES = {"a": "127.0.0.2", "b": "127.0.0.3"}
NAME = "diffusion.mesh.test"
SMALL = generation_pb2.GenerationParams(prompt="two nodes", width=64, height=48, num_inference_steps=1, seed=11)
RPC_TIMEOUT_S = 60.0
REJOIN_TIMEOUT_S = 120.0  # a bound for the failure message, not a measurement: it takes seconds
EXECUTE_OK = 'method="stagemesh.v1.StageService/Execute"'


def free_port_on_every_node() -> int:
    """A TCP port free on each node's address, so that one DNS name with one port reaches both."""
    while True:
        sockets = [socket.socket() for _ in NODES]
        try:
            sockets[0].bind((NODES["a"], 0))
            port = sockets[0].getsockname()[1]
            try:
                sockets[1].bind((NODES["b"], port))
            except OSError:
                continue
            return port
        finally:
            for s in sockets:
                s.close()


@dataclass
class Node:
    name: str
    host: str
    folder: Path
    cache: Service
    cache_address: str = ""
    replica: Service | None = None

    def start_replica(self, model_dir: str, port: int) -> Service:
        root = self.folder / "rt"
        self.replica = spawn_service(
            f"stage-1-{self.name}",
            [
                "stage",
                "--stage-id=1",
                "--kind=diffusion",
                f"--host={self.host}",
                f"--model-dir={model_dir}",
                "--threads=1",
                "--max-size=512",
                "--metrics-port=0",
                # as the Kubernetes manifests run it: DLO with the node's runtime-weight cache
                "--enable-dlo",
                "--dlo-no-use-allgather",
                "--dlo-enable-runtime-cache",
                "--no-dlo-checkpoint-mmap",
                f"--dlo-runtime-cache-dir={root}",
                f"--dlo-runtime-cache-service={self.cache_address}",
            ],
            self.folder,
            port=port,
        )
        return self.replica

    def executed(self) -> int:
        """Execute calls this node's replica finished OK, from its own /metrics."""
        assert self.replica is not None
        info = readyfile.read(self.replica.ready_path)
        assert info is not None and "metrics" in info, "the replica has not bound yet"
        with urllib.request.urlopen(f"http://{info['metrics']}/metrics", timeout=RPC_TIMEOUT_S) as reply:
            text = reply.read().decode()
        return sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith("stagemesh_requests_total{") and EXECUTE_OK in line and 'code="OK"' in line
        )

    def cache_entries(self) -> list[cache_pb2.CacheEntry]:
        with grpc.insecure_channel(self.cache_address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            return list(stub.ListEntries(cache_pb2.ListEntriesRequest(), timeout=RPC_TIMEOUT_S).entries)


def serving(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        updates = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=START_TIMEOUT_S)
        for update in updates:
            if update.status == health_pb2.HealthCheckResponse.SERVING:
                updates.cancel()
                return


@dataclass
class TwoNodes:
    nodes: dict[str, Node]
    port: int
    model_dir: str
    gateway_service: Service
    gateway: gateway_pb2_grpc.GatewayServiceStub
    dns: DnsStub

    def generate(self) -> None:
        reply = self.gateway.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=RPC_TIMEOUT_S)
        assert reply.result.png.startswith(b"\x89PNG")

    def stage_1(self) -> gateway_pb2.StageInfo:
        return self.gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=RPC_TIMEOUT_S).stages[1]


@pytest.fixture(scope="module")
def two_nodes(mesh, tmp_path_factory, model_dir) -> Iterator[TwoNodes]:
    root = tmp_path_factory.mktemp("two-nodes")
    nodes = {}
    for name, host in NODES.items():
        folder = root / f"node-{name}"
        folder.mkdir()
        cache = spawn_service(f"cache-{name}", ["cache", f"--host={host}", f"--root={folder / 'rt'}"], folder)
        nodes[name] = Node(name, host, folder, cache)
    port = free_port_on_every_node()
    dns = DnsStub({NAME: list(NODES.values())})
    gateway = None
    try:
        for node in nodes.values():
            node.cache_address = node.cache.wait_bound()
            node.start_replica(model_dir, port)  # both load at once
        stage_0 = mesh.child_addresses()["stage-0"]
        gateway = spawn_service("gateway", ["gateway", f"--stage={stage_0}", f"--stage={dns.target(NAME, port)}"], root)
        address = gateway.wait_bound()
        serving(address)  # every replica of every stage described itself ready
        with grpc.insecure_channel(address, options=rpc.channel_options()) as channel:
            yield TwoNodes(nodes, port, model_dir, gateway, gateway_pb2_grpc.GatewayServiceStub(channel), dns)
    finally:
        services = [s for s in (gateway, *(s for n in nodes.values() for s in (n.replica, n.cache))) if s is not None]
        for service in services:  # all at once: each drains on its own
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        codes = {s.log_path.stem: s.stop() for s in services}
        dns.close()
        assert set(codes.values()) <= {0}, (codes, gateway.logs()[-3000:] if gateway else "")


def test_one_name_spreads_requests_over_both_nodes(two_nodes):
    assert two_nodes.stage_1().replicas == 2  # the name resolved to both nodes
    before = {name: node.executed() for name, node in two_nodes.nodes.items()}
    for _ in range(6):
        two_nodes.generate()
    served = {name: node.executed() - before[name] for name, node in two_nodes.nodes.items()}
    assert sum(served.values()) == 6 and all(served.values()), served  # round_robin: both took some
    for node in two_nodes.nodes.values():  # each node's replica published into its own node's cache
        assert [e for e in node.cache_entries() if e.valid and e.tensor_count > 1], node.name
    assert two_nodes.dns.queries[NAME, 1] >= 2  # gRPC's resolver and the control calls asked it


def test_a_killed_node_leaves_the_other_serving_and_rejoins_when_restarted(two_nodes):
    a, b = two_nodes.nodes["a"], two_nodes.nodes["b"]
    assert a.replica is not None
    killed = a.replica.process.pid
    workers = descendants(killed)
    shm_before = shm_entries()
    a.replica.process.send_signal(signal.SIGKILL)
    a.replica.process.wait()

    served_by_b = b.executed()
    for _ in range(6):  # every request succeeds, on node b
        two_nodes.generate()
    assert b.executed() - served_by_b == 6
    stage = two_nodes.stage_1()  # the replica that does not answer is left out, not the stage
    assert stage.state == gateway_pb2.STAGE_STATE_SERVING

    # The killed stage's workers notice they are orphaned, sweep their shared memory and exit.
    deadline = time.monotonic() + START_TIMEOUT_S
    while any(alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers of the killed stage still run: {workers}"
        time.sleep(0.1)
    assert not segments_of(shm_entries() - shm_before, [killed]), "the killed stage left shared memory behind"

    restarted = a.start_replica(two_nodes.model_dir, two_nodes.port)  # same address, same port
    serving(restarted.wait_bound())
    deadline = time.monotonic() + REJOIN_TIMEOUT_S
    while a.executed() == 0:  # the gateway dials it again (backoff capped at 5 s) and round_robin uses it
        assert time.monotonic() < deadline, "the restarted replica was never used again"
        two_nodes.generate()
    assert two_nodes.stage_1().replicas == 2

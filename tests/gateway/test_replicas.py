"""Control calls reach every replica of a stage.

A mesh of standalone services, as deployed across machines: stage 0 (ar), two replicas of stage 1
(diffusion), a gateway started with `--stage A --stage B1,B2`. Stages serve TLS and every service
shares one bearer token, so the gateway's per-replica control channels must carry both.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.core import auth, rpc, tls
from stagemesh.gateway.stages import NO_WORKER_RANK, DnsTarget, aggregate, dns_target, resolve
from stagemesh.v1 import control_pb2, gateway_pb2, gateway_pb2_grpc, generation_pb2, stage_pb2, stage_pb2_grpc
from tests.core.test_security import make_certificates
from tests.support.meshproc import START_TIMEOUT_S, Service, spawn_service

pytestmark = pytest.mark.timeout(240)

TOKEN = "replica-token-" + "r" * 20
CONTROL = (("authorization", f"Bearer {TOKEN}"),)
SMALL = generation_pb2.GenerationParams(prompt="two of them", width=64, height=48, num_inference_steps=1, seed=5)
SUCCESS, ERROR = control_pb2.CONTROL_STATUS_SUCCESS, control_pb2.CONTROL_STATUS_ERROR
ACK_SUCCESS = control_pb2.ACK_STATUS_SUCCESS
RPC_TIMEOUT_S = 60.0


class Replicated:
    def __init__(self, gateway: Service, address: str, replicas: dict[str, Service], ca: str):
        self.gateway_service, self.address, self.replicas, self.ca = gateway, address, replicas, ca
        self.channel = grpc.insecure_channel(address, options=rpc.channel_options())
        self.gateway = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    def describe(self, replica: str) -> stage_pb2.DescribeStageResponse:
        """What one replica says of itself, asked directly (over TLS, with the token, as the gateway does)."""
        with tls.channel(replica, self.ca, rpc.channel_options()) as channel:
            return stage_pb2_grpc.StageServiceStub(channel).DescribeStage(
                stage_pb2.DescribeStageRequest(), timeout=RPC_TIMEOUT_S, metadata=CONTROL
            )

    def generate(self) -> gateway_pb2.GenerateUnaryResponse:
        return self.gateway.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=RPC_TIMEOUT_S)

    def stage(self, stage_id: int) -> gateway_pb2.StageInfo:
        return self.gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=RPC_TIMEOUT_S).stages[stage_id]


def _wait_serving(channel: grpc.Channel) -> None:
    """Health turns SERVING once every replica of every stage described itself ready."""
    updates = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=START_TIMEOUT_S)
    for update in updates:
        if update.status == health_pb2.HealthCheckResponse.SERVING:
            updates.cancel()
            return


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("replicas")
    pki = make_certificates(root)
    env = {**os.environ, auth.TOKEN_ENV: TOKEN}
    serve_tls = ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])]

    def stage(name: str, stage_id: int, kind: str) -> Service:
        return spawn_service(
            name,
            [
                "stage",
                "--stage-id",
                str(stage_id),
                "--kind",
                kind,
                "--model-dir",
                model_dir,
                "--threads",
                "1",
                "--max-size",
                "512",
                *serve_tls,
            ],
            root,
            env,
        )

    stages = {
        "a": stage("stage-0", 0, "ar"),
        "b1": stage("stage-1a", 1, "diffusion"),
        "b2": stage("stage-1b", 1, "diffusion"),
    }  # all three load at once
    addresses = {name: service.wait_bound() for name, service in stages.items()}
    gateway = spawn_service(
        "gateway",
        [
            "gateway",
            "--stage",
            addresses["a"],
            "--tls-ca",
            str(pki["ca"]),
            "--stage",
            f"{addresses['b1']},{addresses['b2']}",
        ],
        root,
        env,
    )
    mesh = Replicated(gateway, gateway.wait_bound(), {addresses[n]: stages[n] for n in ("b1", "b2")}, str(pki["ca"]))
    try:
        _wait_serving(mesh.channel)
        yield mesh
    finally:
        mesh.channel.close()
        codes = {s.log_path.stem: s.stop() for s in (gateway, *stages.values())}
        assert set(codes.values()) == {0}, (codes, gateway.logs()[-3000:])


@pytest.mark.mesh
def test_generate_and_list_stages_count_every_replica(replicated):
    assert replicated.generate().result.png.startswith(b"\x89PNG")
    stage0, stage1 = replicated.stage(0), replicated.stage(1)
    assert (stage0.replicas, stage1.replicas) == (1, 2)
    assert stage1.state == gateway_pb2.STAGE_STATE_SERVING and stage1.kind == "diffusion"
    each = [replicated.describe(address) for address in replicated.replicas]
    assert stage1.device_memory_bytes == sum(d.device_memory_bytes for d in each)  # 0 on a CPU
    assert all(d.ready and d.stage_id == 1 for d in each)


@pytest.mark.mesh
def test_sleep_and_wake_reach_every_replica(replicated):
    reply = replicated.gateway.Sleep(gateway_pb2.SleepRequest(stage_ids=[1]), metadata=CONTROL, timeout=RPC_TIMEOUT_S)
    assert reply.status == SUCCESS, reply
    assert len(reply.acks) == 2 and all(
        a.stage_id == 1 and a.status == ACK_SUCCESS and a.level == 2 for a in reply.acks
    ), reply
    assert [replicated.describe(a).sleep_level for a in replicated.replicas] == [2, 2]
    assert replicated.stage(1).state == gateway_pb2.STAGE_STATE_SLEEPING

    reply = replicated.gateway.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), metadata=CONTROL, timeout=RPC_TIMEOUT_S)
    assert reply.status == SUCCESS and len(reply.acks) == 2, reply
    assert all(a.status == ACK_SUCCESS and a.freed_bytes > 0 for a in reply.acks), reply
    assert [replicated.describe(a).sleep_level for a in replicated.replicas] == [0, 0]
    assert replicated.stage(1).state == gateway_pb2.STAGE_STATE_SERVING
    # The pipeline has an AR stage: it stays paused after WakeUp until ResumeGeneration.
    replicated.gateway.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), metadata=CONTROL, timeout=RPC_TIMEOUT_S)
    assert replicated.generate().result.png.startswith(b"\x89PNG")


@pytest.mark.mesh
def test_a_replica_that_cannot_sleep_is_named(replicated):
    """Runs last: it stops the second replica."""
    awake, gone = list(replicated.replicas)
    assert replicated.replicas[gone].stop() == 0
    reply = replicated.gateway.Sleep(
        gateway_pb2.SleepRequest(stage_ids=[1], level=1), metadata=CONTROL, timeout=RPC_TIMEOUT_S
    )
    assert reply.status == ERROR, reply
    slept, failed = reply.acks  # replica by replica, in --stage order
    assert slept.status == ACK_SUCCESS and slept.rank == 0 and slept.level == 1
    assert failed.status == control_pb2.ACK_STATUS_ERROR and failed.rank == NO_WORKER_RANK and failed.stage_id == 1
    assert f"replica {gone}" in failed.error and "unavailable" in failed.error, failed.error
    assert replicated.describe(awake).sleep_level == 1
    # One replica sleeps, so the stage counts as asleep: no work is routed into it.
    with pytest.raises(grpc.RpcError) as refused:
        replicated.generate()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stage 1" in refused.value.details()

    reply = replicated.gateway.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), metadata=CONTROL, timeout=RPC_TIMEOUT_S)
    assert reply.status == ERROR and [a.status for a in reply.acks] == [ACK_SUCCESS, control_pb2.ACK_STATUS_ERROR]
    assert replicated.describe(awake).sleep_level == 0


# ---- the pieces, without servers ------------------------------------------------------------------
@pytest.mark.parametrize(
    "target, expected",
    [
        ("dns:///diffusion.internal:50062", DnsTarget("diffusion.internal", 50062)),
        ("dns://10.0.0.2:53/diffusion.internal:7", DnsTarget("diffusion.internal", 7, ("10.0.0.2", 53))),
        ("dns:diffusion.internal", DnsTarget("diffusion.internal", 443)),
        ("dns:///[fd00::11]:50062", DnsTarget("fd00::11", 50062)),
        ("10.0.0.11:50062", None),
    ],
)
def test_dns_targets_are_split_into_host_port_and_server(target, expected):
    assert dns_target(target) == expected


def test_resolve_formats_every_address_as_a_target():
    assert asyncio.run(resolve(DnsTarget("127.0.0.1", 50062))) == ["127.0.0.1:50062"]
    assert asyncio.run(resolve(DnsTarget("::1", 50062))) == ["[::1]:50062"]


def test_aggregate_sums_memory_and_sleeps_if_any_replica_sleeps():
    one = stage_pb2.DescribeStageResponse(
        kind="diffusion", ready=True, supports_sleep=True, device="cpu", device_memory_bytes=100, workers=1
    )
    two = stage_pb2.DescribeStageResponse(
        kind="diffusion", ready=True, supports_sleep=True, device="cpu", device_memory_bytes=0, workers=1, sleep_level=2
    )
    total = aggregate([one, two])
    assert (total.device_memory_bytes, total.workers, total.sleep_level, total.device) == (100, 2, 2, "cpu")
    assert total.ready and total.supports_sleep
    assert not aggregate([one, stage_pb2.DescribeStageResponse(kind="diffusion")]).ready


def test_aggregate_sums_the_replicas_load():
    one = stage_pb2.DescribeStageResponse(kind="ar", queue_depth=3, batches=4, batched_requests=10, max_batch_size=4)
    two = stage_pb2.DescribeStageResponse(kind="ar", queue_depth=1, batches=2, batched_requests=2, max_batch_size=4)
    total = aggregate([one, two])
    assert (total.queue_depth, total.batches, total.batched_requests, total.max_batch_size) == (4, 6, 12, 4)

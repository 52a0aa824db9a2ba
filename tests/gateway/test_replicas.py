"""Control calls reach every replica of a stage, and a replica restarted while its stage sleeps
is put back to sleep alone.

A mesh of standalone services, as deployed across machines: stage 0 (ar), two replicas of stage 1
(diffusion), a gateway started with `--stage A --stage B1,B2`. Stages serve TLS and every service
shares one bearer token, so the gateway's per-replica control channels must carry both.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable

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
    def __init__(
        self,
        gateway: Service,
        address: str,
        replicas: dict[str, Service],
        ca: str,
        respawn: Callable[[str], Service],
    ):
        self.gateway_service, self.address, self.replicas, self.ca = gateway, address, replicas, ca
        self.respawn = respawn  # address -> the replica started again on its port
        self.channel = grpc.insecure_channel(address, options=rpc.channel_options())
        self.gateway = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    def describe(self, replica: str) -> stage_pb2.DescribeStageResponse:
        """What one replica says of itself, asked directly (over TLS, with the token, as the gateway does)."""
        with tls.channel(replica, self.ca, rpc.channel_options()) as channel:
            return stage_pb2_grpc.StageServiceStub(channel).DescribeStage(
                stage_pb2.DescribeStageRequest(), timeout=RPC_TIMEOUT_S, metadata=CONTROL
            )

    def describe_if_up(self, replica: str) -> stage_pb2.DescribeStageResponse | None:
        """As describe, None while the replica does not answer (it is starting)."""
        try:
            return self.describe(replica)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return None

    def generate(self) -> gateway_pb2.GenerateUnaryResponse:
        return self.gateway.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=RPC_TIMEOUT_S)

    def stage(self, stage_id: int) -> gateway_pb2.StageInfo:
        return self.gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=RPC_TIMEOUT_S).stages[stage_id]


def sleep_calls(replica: Service) -> int:
    """The SleepStage calls a replica answered, from its log (a restarted one's log continues it)."""
    calls = 0
    for line in replica.logs().splitlines():
        if "SleepStage" in line and line.startswith("{"):
            entry = json.loads(line)
            calls += entry.get("event") == "rpc done" and entry.get("method") == "SleepStage"
    return calls


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

    def stage(name: str, stage_id: int, kind: str, port: int = 0) -> Service:
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
            port,
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
    names = {addresses[n]: stages[n].log_path.stem for n in ("b1", "b2")}

    def respawn(address: str) -> Service:
        replica = stage(names[address], 1, "diffusion", int(address.rsplit(":", 1)[1]))
        assert replica.wait_bound() == address
        return replica

    replicas = {addresses[n]: stages[n] for n in ("b1", "b2")}
    mesh = Replicated(gateway, gateway.wait_bound(), replicas, str(pki["ca"]), respawn)
    try:
        _wait_serving(mesh.channel)
        yield mesh
    finally:
        mesh.channel.close()
        codes = {s.log_path.stem: s.stop() for s in (gateway, stages["a"], *mesh.replicas.values())}
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
def test_a_replica_restarted_while_its_stage_sleeps_is_put_back_to_sleep_alone(replicated):
    """The gateway's watch sleeps the restarted replica again at the level asked for, and calls
    only that one; until WakeUp the stage stays asleep for ListStages and admission alike."""
    kept, restarted = list(replicated.replicas)
    reply = replicated.gateway.Sleep(
        gateway_pb2.SleepRequest(stage_ids=[1], level=1), metadata=CONTROL, timeout=RPC_TIMEOUT_S
    )
    assert reply.status == SUCCESS, reply
    kept_sleeps = sleep_calls(replicated.replicas[kept])
    killed = replicated.replicas[restarted].process
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(RPC_TIMEOUT_S) == -signal.SIGKILL
    replicated.replicas[restarted] = replicated.respawn(restarted)

    deadline = time.monotonic() + START_TIMEOUT_S
    while (described := replicated.describe_if_up(restarted)) is None or described.sleep_level != 1:
        assert time.monotonic() < deadline, f"the restarted replica is not asleep: {described}"
        time.sleep(0.2)
    assert described.ready
    assert sleep_calls(replicated.replicas[kept]) == kept_sleeps  # the sleeping replica was left alone
    assert replicated.describe(kept).sleep_level == 1
    stage = replicated.stage(1)
    assert (stage.state, stage.sleep_level, stage.replicas) == (gateway_pb2.STAGE_STATE_SLEEPING, 1, 2)
    with pytest.raises(grpc.RpcError) as refused:
        replicated.generate()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stage 1" in refused.value.details()

    reply = replicated.gateway.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), metadata=CONTROL, timeout=RPC_TIMEOUT_S)
    assert reply.status == SUCCESS and [a.level for a in reply.acks] == [1, 1], reply
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

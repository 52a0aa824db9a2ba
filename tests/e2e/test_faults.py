"""Faults over a real `stagemesh up`: a worker of the AR stage killed (health NOT_SERVING then
SERVING), the AR stage service killed (UNAVAILABLE at once), the diffusion stage service killed
while asleep (back asleep after its restart), the cache service killed while clients generate,
the gateway killed while clients keep calling. test_lifecycle.py covers the
diffusion stage's kills and the clean stop; test_api_errors.py covers cancel and deadline.

The tests kill processes of their own module mesh, never of the shared session one."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.v1 import cache_pb2, cache_pb2_grpc, control_pb2, gateway_pb2, stage_pb2, stage_pb2_grpc
from tests.e2e.test_lifecycle import (
    SMALL,
    cmdline,
    generate,
    generate_until_ok,
    parent_of,
    start,
    wait_until,
    worker_pids,
)
from tests.support.meshproc import Mesh, alive, descendants, segments_of, shm_entries

pytestmark = pytest.mark.mesh

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
RECOVERY_S = 60.0
RETRY_PAUSE_S = 0.05  # a client's pause between failed attempts, so a dead port is not hammered


def child_pid(mesh: Mesh, command: str, stage_id: int | None = None) -> int | None:
    """The live `stagemesh <command>` child of `up` (None while the supervisor restarts it)."""
    for pid in descendants(mesh.process.pid):
        argv = cmdline(pid)
        if parent_of(pid) != mesh.process.pid or argv[1:4] != ["-m", "stagemesh", command] or not alive(pid):
            continue
        if stage_id is None or argv[argv.index("--stage-id") + 1] == str(stage_id):
            return pid
    return None


def restarts_logged(mesh: Mesh, child: str) -> int:
    return sum(
        1 for line in mesh.logs().splitlines() if '"child exited; restarting"' in line and f'"child": "{child}"' in line
    )


@pytest.fixture(scope="module")
def fault_mesh(tmp_path_factory, model_dir):
    """A mesh the tests below kill parts of; stopping it at the end must still be clean."""
    shm_before = shm_entries()
    mesh = start(tmp_path_factory.mktemp("fault-mesh"), model_dir)
    mesh.seen = set()  # every pid the mesh had, killed ones included
    yield mesh
    mesh.seen.update(descendants(mesh.process.pid))
    assert mesh.stop() == 0, mesh.logs()[-3000:]
    assert not segments_of(shm_entries() - shm_before, mesh.seen | mesh.child_pids()), "segments left behind"
    assert "Traceback" not in mesh.logs()


def test_ar_worker_killed_turns_stage_health_not_serving_then_serving(fault_mesh):
    mesh = fault_mesh
    generate_until_ok(mesh)
    stage0 = child_pid(mesh, "stage", 0)
    [worker] = worker_pids(stage0)
    mesh.seen.update([stage0, worker])
    with grpc.insecure_channel(mesh.child_addresses()["stage-0"]) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=RECOVERY_S)
        statuses = [next(watch).status]  # the current status comes first
        os.kill(worker, signal.SIGKILL)
        statuses.append(next(watch).status)
        # While the worker restarts, the gateway refuses at once and names the stage,
        with pytest.raises(grpc.RpcError) as info:
            generate(mesh, timeout=10.0)
        # and a control call fails with an ACK naming the worker, instead of an empty SUCCESS.
        [ack] = (
            stage_pb2_grpc.StageServiceStub(channel).SleepStage(stage_pb2.SleepStageRequest(level=1), timeout=10.0).acks
        )
        statuses.append(next(watch).status)
        watch.cancel()
    assert statuses == [SERVING, NOT_SERVING, SERVING]
    assert (ack.rank, ack.status) == (0, control_pb2.ACK_STATUS_ERROR), ack
    assert "restarted" in ack.error, ack.error
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (info.value.code(), info.value.details())
    assert "stage 0" in info.value.details(), info.value.details()
    result = generate(mesh)  # no retry: SERVING means it serves
    assert (result.width, result.height) == (SMALL.width, SMALL.height)
    [new_worker] = worker_pids(stage0)
    assert new_worker != worker and child_pid(mesh, "stage", 0) == stage0


def test_killed_ar_stage_service_fails_calls_at_once_then_serves_behind_the_same_gateway(fault_mesh):
    mesh = fault_mesh
    generate_until_ok(mesh)
    gateway, stage0 = child_pid(mesh, "gateway"), child_pid(mesh, "stage", 0)
    mesh.seen.update([stage0, *descendants(stage0)])

    os.kill(stage0, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        generate(mesh, timeout=10.0)
    answered_s = time.monotonic() - started
    generate_until_ok(mesh)

    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (info.value.code(), info.value.details())
    assert "stage 0" in info.value.details(), info.value.details()
    # Not waiting for the restart (0.5 s backoff, then seconds of start-up and model load).
    assert answered_s < 2.0, f"the refusal took {answered_s:.2f} s"
    assert child_pid(mesh, "stage", 0) not in (None, stage0)
    assert child_pid(mesh, "gateway") == gateway
    assert restarts_logged(mesh, "stage-0") == 1


def stage_sleep_events(mesh: Mesh, service: str) -> list[dict]:
    """The "stage asleep" lines `service` logged: one per SleepStage it answered."""
    events = []
    for line in mesh.logs().splitlines():
        if '"stage asleep"' in line:
            entry = json.loads(line)
            if entry.get("event") == "stage asleep" and entry.get("service") == service:
                events.append(entry)
    return events


def test_stage_killed_while_asleep_comes_back_asleep_at_its_level(fault_mesh):
    """The operator's Sleep holds across a restart: the restarted stage loads its weights awake,
    the gateway's watch puts it back to sleep at level 1, and ListStages, the stage itself and
    admission agree; WakeUp then brings it back."""
    mesh = fault_mesh
    generate_until_ok(mesh)
    with mesh.channel() as channel:
        gateway = mesh.gateway(channel)
        slept = gateway.Sleep(gateway_pb2.SleepRequest(stage_ids=[1], level=1), timeout=RECOVERY_S)
        assert slept.status == control_pb2.CONTROL_STATUS_SUCCESS, slept
        sleeps_before = len(stage_sleep_events(mesh, "stage-1"))
        stage1 = child_pid(mesh, "stage", 1)
        mesh.seen.update([stage1, *descendants(stage1)])

        os.kill(stage1, signal.SIGKILL)
        wait_until(lambda: child_pid(mesh, "stage", 1) not in (None, stage1), RECOVERY_S, "stage 1 restarted")

        def listed() -> tuple[int, int] | None:
            stage = gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=10).stages[1]
            return (stage.state, stage.sleep_level) if stage.state == gateway_pb2.STAGE_STATE_SLEEPING else None

        assert wait_until(listed, RECOVERY_S, "ListStages shows stage 1 asleep") == (
            gateway_pb2.STAGE_STATE_SLEEPING,
            1,
        )
        with grpc.insecure_channel(mesh.child_addresses()["stage-1"]) as stage_channel:
            described = stage_pb2_grpc.StageServiceStub(stage_channel).DescribeStage(
                stage_pb2.DescribeStageRequest(), timeout=10
            )
        # The restarted stage slept once more, freeing what its load took.
        [resleep] = stage_sleep_events(mesh, "stage-1")[sleeps_before:]
        with pytest.raises(grpc.RpcError) as refused:
            generate(mesh, timeout=10.0)

        woken = gateway.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), timeout=RECOVERY_S)
        assert woken.status == control_pb2.CONTROL_STATUS_SUCCESS, woken
        assert [(a.stage_id, a.level) for a in woken.acks] == [(1, 1)]
        gateway.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=10)
        states = [
            (s.state, s.sleep_level) for s in gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=10).stages
        ]
    assert (described.ready, described.sleep_level) == (True, 1)
    assert resleep["freed_bytes"] > 0, resleep
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    assert "stage 1 is asleep (level 1)" in refused.value.details()
    assert states == [(gateway_pb2.STAGE_STATE_SERVING, 0)] * 2
    result = generate(mesh)
    assert (result.width, result.height) == (SMALL.width, SMALL.height)
    assert restarts_logged(mesh, "stage-1") == 1


@dataclass
class Caller:
    """A client thread calling GenerateUnary in a loop on its own channel, recording each outcome."""

    mesh: Mesh
    stop: threading.Event
    outcomes: list[grpc.StatusCode] = field(default_factory=list)
    first_ok: threading.Event = field(default_factory=threading.Event)
    recovered: threading.Event = field(default_factory=threading.Event)  # an OK after a failure

    def run(self) -> None:
        with self.mesh.channel() as channel:
            stub = self.mesh.gateway(channel)
            while not self.stop.is_set():
                try:
                    stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=10.0)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as err:
                    code = err.code()
                self.outcomes.append(code)
                if code == grpc.StatusCode.OK:
                    self.first_ok.set()
                    if len(set(self.outcomes)) > 1:
                        self.recovered.set()
                else:
                    self.stop.wait(RETRY_PAUSE_S)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        return thread


def test_cache_service_killed_while_clients_generate_loses_no_request(fault_mesh):
    mesh = fault_mesh
    generate_until_ok(mesh)
    cache = child_pid(mesh, "cache")
    mesh.seen.add(cache)
    caller = Caller(mesh, threading.Event())
    thread = caller.start()
    try:
        assert caller.first_ok.wait(RECOVERY_S)
        os.kill(cache, signal.SIGKILL)
        new_cache = wait_until(
            lambda: child_pid(mesh, "cache") not in (None, cache) and child_pid(mesh, "cache"),
            RECOVERY_S,
            "the supervisor restarts the cache service",
        )
        with grpc.insecure_channel(mesh.child_addresses()["cache"]) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=RECOVERY_S, wait_for_ready=True
            )
            stats = cache_pb2_grpc.CacheServiceStub(channel).GetStats(cache_pb2.GetStatsRequest(), timeout=10)
        served_before = len(caller.outcomes)
        wait_until(lambda: len(caller.outcomes) > served_before, RECOVERY_S, "a Generate after the restart")
    finally:
        caller.stop.set()
        thread.join(RECOVERY_S)
    assert set(caller.outcomes) == {grpc.StatusCode.OK}, caller.outcomes
    assert health.status == SERVING and stats.root
    assert new_cache != cache and restarts_logged(mesh, "cache") == 1


def test_gateway_killed_while_clients_keep_calling_they_see_unavailable_then_succeed(fault_mesh):
    mesh = fault_mesh
    generate_until_ok(mesh)
    gateway = child_pid(mesh, "gateway")
    mesh.seen.add(gateway)
    stop = threading.Event()
    callers = [Caller(mesh, stop) for _ in range(4)]
    threads = [c.start() for c in callers]
    try:
        assert all(c.first_ok.wait(RECOVERY_S) for c in callers)
        os.kill(gateway, signal.SIGKILL)
        for c in callers:
            assert c.recovered.wait(RECOVERY_S), f"a client never succeeded again: {c.outcomes[-10:]}"
    finally:
        stop.set()
        for t in threads:
            t.join(RECOVERY_S)

    for c in callers:
        codes = c.outcomes
        first_failure = codes.index(grpc.StatusCode.UNAVAILABLE)
        last_failure = len(codes) - 1 - codes[::-1].index(grpc.StatusCode.UNAVAILABLE)
        # OK before the kill, only UNAVAILABLE while the gateway is down, OK once it is back.
        assert set(codes[:first_failure]) == {grpc.StatusCode.OK}, codes
        assert set(codes[first_failure : last_failure + 1]) == {grpc.StatusCode.UNAVAILABLE}, codes
        assert set(codes[last_failure + 1 :]) == {grpc.StatusCode.OK}, codes
    assert child_pid(mesh, "gateway") not in (None, gateway)
    assert restarts_logged(mesh, "gateway") == 1
    assert not alive(gateway)

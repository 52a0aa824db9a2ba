"""/dev/shm is shared by every local user and sticky: names another uid creates under a stage's
segment pattern must neither stop the stage from starting, nor kill its result pump when a worker
dies (the worker would never be restarted), nor keep a worker alive after its stage service was
SIGKILLed. The squats here are directories owned by `nobody`: even root cannot unlink() them, as
nobody can remove another user's file from a sticky directory."""

from __future__ import annotations

import json
import os
import secrets
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.stage_service.transport import ipc
from stagemesh.v1 import generation_pb2, stage_pb2, stage_pb2_grpc
from tests.e2e.test_lifecycle import wait_until, worker_pids
from tests.support.meshproc import alive, spawn_service

pytestmark = pytest.mark.mesh

NOBODY = 65534
SERVING = health_pb2.HealthCheckResponse.SERVING
SHM = Path("/dev/shm")


def squat(owner_pid: int, rank: int = 0) -> Path:
    path = SHM / f"{ipc.SHM_PREFIX}-{owner_pid}-{rank}-{secrets.token_hex(16)}"
    path.mkdir(mode=0o755)
    os.chown(path, NOBODY, NOBODY)
    return path


def dead_pid() -> int:
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


@pytest.fixture
def squats():
    made: list[Path] = []
    yield made
    for path in made:
        path.rmdir()


def start_ar_stage(tmp_path: Path, model_dir: Path):
    stage = spawn_service(
        "stage-0", ["stage", "--stage-id", "0", "--kind", "ar", "--model-dir", str(model_dir)], tmp_path
    )
    return stage, stage.wait_bound()


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == SERVING


def execute(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        request = stage_pb2.ExecuteRequest(params=generation_pb2.GenerationParams(prompt="a squat", seed=1))
        replies = list(stage_pb2_grpc.StageServiceStub(channel).Execute(request, timeout=60))
    assert replies[-1].HasField("outputs")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_another_users_segment_names_neither_stop_a_stage_nor_its_worker_restarts(tmp_path, tiny_model, squats):
    squats.append(squat(dead_pid()))  # what the start-up sweep of dead executors' segments meets
    stage, address = start_ar_stage(tmp_path, tiny_model)
    try:
        wait_until(lambda: serving(address), 120, "the stage serves despite a foreign segment name")
        squats.append(squat(stage.process.pid))  # named after the running stage, as its own would be
        [worker] = worker_pids(stage.process.pid)
        os.kill(worker, signal.SIGKILL)
        wait_until(
            lambda: (pids := worker_pids(stage.process.pid)) and pids != [worker] and serving(address),
            120,
            "a new worker serves after the old one was killed",
        )
        execute(address)
    finally:
        assert stage.stop() == 0, stage.logs()[-3000:]
    assert "Traceback" not in stage.logs()
    assert all(path.is_dir() for path in squats), "another user's entries are left alone"
    lifecycle = [e for e in map(json.loads, stage.logs().splitlines()) if e["event"].startswith("worker ")]
    assert {e["event"] for e in lifecycle} >= {"worker died", "worker started", "worker ready", "worker restarted"}
    assert {e.get("service") for e in lifecycle} == {"stage-0"}, "every line names its service"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_worker_dies_with_its_sigkilled_stage_service_despite_foreign_names(tmp_path, tiny_model, squats):
    stage, address = start_ar_stage(tmp_path, tiny_model)
    wait_until(lambda: serving(address), 120, "the stage serves")
    [worker] = worker_pids(stage.process.pid)
    squats.append(squat(stage.process.pid))
    stage.process.send_signal(signal.SIGKILL)
    stage.process.wait(10)
    wait_until(lambda: not alive(worker), 10, "the orphaned worker exits")

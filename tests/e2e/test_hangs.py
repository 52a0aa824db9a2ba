"""A worker that stops (SIGSTOP) or gets stuck must not hold a stage forever: the stage hears no
heartbeat for `hang_timeout_s`, kills the worker, fails what it owed with UNAVAILABLE and restarts
its group, without anyone sending SIGCONT."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import pytest

from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.e2e.test_faults import child_pid
from tests.e2e.test_lifecycle import generate_until_ok, worker_pids
from tests.support.meshproc import start_mesh, write_config

pytestmark = pytest.mark.mesh

HANG_TIMEOUT_S = 3
LONG = generation_pb2.GenerationParams(prompt="a long night", width=512, height=512, num_inference_steps=50, seed=3)


@pytest.fixture(scope="module")
def hang_mesh(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("hang-mesh")
    config = write_config(root / "mesh.toml", model_dir, extra_diffusion=f"hang_timeout_s = {HANG_TIMEOUT_S}")
    mesh = start_mesh(config, root / "mesh.log")
    yield mesh
    assert mesh.stop() == 0, mesh.logs()[-3000:]


def test_a_stopped_worker_is_killed_and_its_request_answered_unavailable(hang_mesh):
    mesh = hang_mesh
    generate_until_ok(mesh)
    [worker] = worker_pids(child_pid(mesh, "stage", 1))
    stepping = threading.Event()
    outcome: list[object] = []

    def long_call() -> None:
        with mesh.channel() as channel:
            try:
                for reply in mesh.gateway(channel).Generate(gateway_pb2.GenerateRequest(params=LONG), timeout=120):
                    if reply.HasField("denoising_step") and reply.denoising_step.step >= 2:
                        stepping.set()
            except grpc.RpcError as exc:
                outcome.append(exc)
        stepping.set()

    caller = threading.Thread(target=long_call, daemon=True)
    caller.start()
    assert stepping.wait(60), "the long request never reached its second step"
    os.kill(worker, signal.SIGSTOP)
    stopped_at = time.monotonic()
    caller.join(60)
    answered_after = time.monotonic() - stopped_at
    try:
        assert not caller.is_alive(), "the request still waits on a stopped worker"
        [error] = outcome
        assert error.code() == grpc.StatusCode.UNAVAILABLE, (error.code(), error.details())
        assert "hung" in error.details()
        assert answered_after < HANG_TIMEOUT_S + 10, answered_after
        generate_until_ok(mesh)  # the stage restarted its worker; nobody sent SIGCONT
        assert worker not in worker_pids(child_pid(mesh, "stage", 1))
    finally:
        try:
            os.kill(worker, signal.SIGCONT)  # only matters if the stage failed to kill it
        except ProcessLookupError:
            pass
    hung = [e for e in map(json.loads, mesh.logs().splitlines()) if e.get("event") == "worker hung; killing it"]
    assert [e["service"] for e in hung] == ["stage-1"]

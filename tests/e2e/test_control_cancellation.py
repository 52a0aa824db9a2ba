"""Control calls whose callers leave midway, through a real mesh: a PauseGeneration whose deadline
passes while an admitted call is still being submitted leaves generation open; a Sleep or WakeUp
whose caller's deadline passes still finishes, and the gateway's record of sleeping stages
follows what the stages did. Stage 0 or 1 is held with SIGSTOP to keep the call waiting."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.e2e.test_faults import child_pid
from tests.e2e.test_lifecycle import generate_until_ok
from tests.support.meshproc import start_mesh, write_config

pytestmark = pytest.mark.mesh

SHORT_DEADLINE_S = 1.0
SMALL = generation_pb2.GenerationParams(prompt="a boat", width=32, height=32, num_inference_steps=1, seed=3)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("control-cancel")
    mesh = start_mesh(write_config(root / "mesh.toml", model_dir), root / "mesh.log")
    generate_until_ok(mesh)
    yield mesh
    assert mesh.stop() == 0, mesh.logs()[-3000:]


@pytest.fixture()
def gateway(mesh):
    with mesh.channel() as channel:
        yield mesh.gateway(channel)


def _admitted_generate_while_stage0_stopped(mesh) -> tuple[int, threading.Thread]:
    """Stop stage 0 and start a Generate: it stays admitted (not yet submitted) until SIGCONT."""
    stage0 = child_pid(mesh, "stage", 0)
    assert stage0 is not None
    os.kill(stage0, signal.SIGSTOP)

    def call() -> None:
        with mesh.channel() as channel:
            try:
                mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=60)
            except grpc.RpcError:
                pass  # its outcome is not what these tests look at

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    time.sleep(0.5)  # let it be admitted
    return stage0, caller


def _deadline_passes(call: Callable, request) -> None:
    with pytest.raises(grpc.RpcError) as left:
        call(request, timeout=SHORT_DEADLINE_S)
    assert left.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, left.value.details()


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def _stage1_level(gateway) -> int:
    return gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=30).stages[1].sleep_level


def test_a_pause_whose_deadline_passes_leaves_generation_open(mesh, gateway):
    stage0, caller = _admitted_generate_while_stage0_stopped(mesh)
    try:
        _deadline_passes(gateway.PauseGeneration, gateway_pb2.PauseGenerationRequest())
        assert not gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=30).generation_paused
    finally:
        os.kill(stage0, signal.SIGCONT)
    caller.join(60)
    generate_until_ok(mesh)


def test_a_sleep_whose_caller_left_finishes_and_is_recorded(mesh, gateway):
    stage0, caller = _admitted_generate_while_stage0_stopped(mesh)
    try:
        _deadline_passes(gateway.Sleep, gateway_pb2.SleepRequest(stage_ids=[1]))
    finally:
        os.kill(stage0, signal.SIGCONT)
    caller.join(60)
    _wait_for(lambda: _stage1_level(gateway) == 2, "stage 1 sleeps")
    with pytest.raises(grpc.RpcError) as refused:
        gateway.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stage 1 is asleep" in refused.value.details()


def test_a_wake_whose_caller_left_finishes_and_is_recorded(mesh, gateway):
    if _stage1_level(gateway) == 0:
        gateway.Sleep(gateway_pb2.SleepRequest(stage_ids=[1]), timeout=60)
    stage1 = child_pid(mesh, "stage", 1)
    assert stage1 is not None
    os.kill(stage1, signal.SIGSTOP)
    try:
        _deadline_passes(gateway.WakeUp, gateway_pb2.WakeUpRequest(stage_ids=[1]))
    finally:
        os.kill(stage1, signal.SIGCONT)
    _wait_for(lambda: _stage1_level(gateway) == 0, "stage 1 is awake")
    # This pipeline has an AR stage: it stays paused after WakeUp until resumed.
    gateway.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=30)
    generate_until_ok(mesh)

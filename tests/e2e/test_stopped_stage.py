"""A stage service process that is stopped (SIGSTOP) keeps its port open and accepts connections
but answers nothing. The gateway must not wait on it for the caller's whole deadline: within
`stage_unresponsive_s` (plus a check interval) the call in flight ends UNAVAILABLE naming the
stage, new calls are refused at once, and after SIGCONT the stage serves again without a restart."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from stagemesh.v1 import control_pb2, gateway_pb2, generation_pb2
from tests.e2e.test_faults import child_pid
from tests.e2e.test_lifecycle import generate_until_ok
from tests.support.meshproc import start_mesh, write_config

pytestmark = pytest.mark.mesh

UNRESPONSIVE_S = 3
# One check round per second and a check timeout of one second past the bound; slack for a busy host.
ANSWER_WITHIN_S = UNRESPONSIVE_S + 2 + 3
LONG = generation_pb2.GenerationParams(prompt="a long night", width=512, height=512, num_inference_steps=50, seed=3)
SMALL = generation_pb2.GenerationParams(prompt="a boat", width=32, height=32, num_inference_steps=1, seed=3)


@pytest.fixture(scope="module")
def stopped_stage_mesh(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("stopped-stage")
    config = write_config(root / "mesh.toml", model_dir, extra_gateway=f"stage_unresponsive_s = {UNRESPONSIVE_S}")
    mesh = start_mesh(config, root / "mesh.log")
    yield mesh
    assert mesh.stop() == 0, mesh.logs()[-3000:]


def _long_call_in_background(mesh, outcome: list) -> tuple[threading.Thread, threading.Event]:
    stepping = threading.Event()

    def call() -> None:
        with mesh.channel() as channel:
            try:
                for reply in mesh.gateway(channel).Generate(gateway_pb2.GenerateRequest(params=LONG), timeout=300):
                    if reply.HasField("denoising_step") and reply.denoising_step.step >= 2:
                        stepping.set()
                outcome.append("finished")
            except grpc.RpcError as exc:
                outcome.append(exc)
        stepping.set()

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    return caller, stepping


def test_a_stopped_stage_fails_calls_in_flight_and_new_ones_until_it_runs_again(stopped_stage_mesh):
    mesh = stopped_stage_mesh
    generate_until_ok(mesh)
    stage = child_pid(mesh, "stage", 1)
    assert stage is not None
    outcome: list[object] = []
    caller, stepping = _long_call_in_background(mesh, outcome)
    assert stepping.wait(120), "the long request never reached its second step"
    os.kill(stage, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        caller.join(ANSWER_WITHIN_S + 5)
        answered_after = time.monotonic() - stopped_at
        assert not caller.is_alive(), "the call in flight still waits on the stopped stage"
        [error] = outcome
        assert isinstance(error, grpc.RpcError), error
        assert error.code() == grpc.StatusCode.UNAVAILABLE, (error.code(), error.details())
        assert "stage 1 (diffusion)" in error.details() and "health check" in error.details()
        assert answered_after <= ANSWER_WITHIN_S, answered_after

        with mesh.channel() as channel:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
            assert "stage 1 (diffusion)" in refused.value.details()
            assert time.monotonic() - started < 1.0
    finally:
        os.kill(stage, signal.SIGCONT)
    generate_until_ok(mesh)
    assert child_pid(mesh, "stage", 1) == stage, "the stage was restarted instead of served again"


def test_a_sleep_of_a_stopped_stage_is_answered_within_the_bound_and_holds_no_control_call(stopped_stage_mesh):
    """The control lock must not wait on a stopped stage for the gateway's floor on control answers
    (minutes): the watch cuts control calls off like Execute calls."""
    mesh = stopped_stage_mesh
    generate_until_ok(mesh)
    stage = child_pid(mesh, "stage", 1)
    assert stage is not None
    os.kill(stage, signal.SIGSTOP)
    try:
        with mesh.channel() as channel:
            gateway = mesh.gateway(channel)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                gateway.Sleep(gateway_pb2.SleepRequest(stage_ids=[1], level=1), timeout=120)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
            assert "stage 1 (diffusion)" in refused.value.details()
            assert time.monotonic() - started <= ANSWER_WITHIN_S
            # The control lock is free again: a call on the other stage is answered at once.
            reply = gateway.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[0]), timeout=10)
            assert reply.status == control_pb2.CONTROL_STATUS_SKIPPED, reply
    finally:
        os.kill(stage, signal.SIGCONT)
    # The stage may still run the Sleep it finds in its socket once it runs again (a sleep that
    # began finishes on its own); WakeUp asks it and wakes it if so.
    with mesh.channel() as channel:
        gateway = mesh.gateway(channel)
        woken = gateway.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), timeout=60)
        assert woken.status in (control_pb2.CONTROL_STATUS_SUCCESS, control_pb2.CONTROL_STATUS_SKIPPED), woken
        gateway.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=10)
    generate_until_ok(mesh)

"""Ordinary client behaviour must not wedge a stage: a Sleep whose deadline passes while the stage
waits for its running batch, and a queued batch whose caller's deadline passes while another
batch runs. Both leave the stage serving, or asleep and reported as such, never stuck between."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from stagemesh.v1 import gateway_pb2, generation_pb2, stage_pb2, stage_pb2_grpc

# The mesh fixtures are found by name (the shared `sleepy` mesh comes from tests/e2e/conftest.py).
from tests.support.sleep_mesh import (  # noqa: F401
    SUCCESS,
    awake_and_open,
    channel,
    generate,
    put_to_sleep,
    reference,
    resume,
    stub,
    wake_up,
)

# The mesh's largest size: calls arriving after its second step find it still running for seconds
# on the CPU (22 steps of 512x512 left, several times the 2 s and 1 s deadlines below).
LONG = generation_pb2.GenerationParams(prompt="a long night", width=512, height=512, num_inference_steps=24, seed=3)
OTHER_SHAPE = generation_pb2.GenerationParams(
    prompt="a short day", width=256, height=256, num_inference_steps=2, seed=4
)
pytestmark = pytest.mark.mesh


class Background:
    """A streaming Generate on a thread; `progressed` is set once it reports denoising step 2."""

    def __init__(self, stub, params) -> None:
        self.progressed = threading.Event()
        self.result: object = None
        self._thread = threading.Thread(target=self._run, args=(stub, params), daemon=True)
        self._thread.start()
        assert self.progressed.wait(120), "the long request never reached its second step"
        assert self.result is None, f"the long request ended early: {self.result}"

    def _run(self, stub, params) -> None:
        try:
            for reply in stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=300):
                if reply.HasField("denoising_step") and reply.denoising_step.step >= 2:
                    self.progressed.set()
                if reply.HasField("result"):
                    self.result = reply.result
        except grpc.RpcError as exc:
            self.result = exc
        self.progressed.set()

    def join(self):
        self._thread.join(300)
        return self.result


def stage_sleep_level(mesh, stage: str) -> int:
    with grpc.insecure_channel(mesh.child_addresses()[stage]) as ch:
        return (
            stage_pb2_grpc.StageServiceStub(ch).DescribeStage(stage_pb2.DescribeStageRequest(), timeout=10).sleep_level
        )


def test_a_sleep_whose_deadline_passes_finishes_on_its_own_and_wakes_again(sleepy, stub):
    running = Background(stub, LONG)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Sleep(gateway_pb2.SleepRequest(stage_ids=[1], level=1), timeout=2)
    assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not isinstance(running.join(), grpc.RpcError), "the batch admitted before the Sleep completes"
    deadline = time.monotonic() + 60
    while stage_sleep_level(sleepy, "stage-1") != 1:
        assert time.monotonic() < deadline, "the sleep never completed after its caller left"
        time.sleep(0.2)
    woken = wake_up(stub, [1])
    assert woken.status == SUCCESS, woken
    resume(stub)
    generate(stub)


def test_a_queued_batch_whose_deadline_passes_frees_the_stage_for_sleep(sleepy, stub):
    running = Background(stub, LONG)
    with pytest.raises(grpc.RpcError) as late:
        stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=OTHER_SHAPE), timeout=1)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not isinstance(running.join(), grpc.RpcError)
    slept = put_to_sleep(stub, [1], level=1)
    assert slept.status == SUCCESS, slept
    assert wake_up(stub, [1]).status == SUCCESS
    resume(stub)
    generate(stub)

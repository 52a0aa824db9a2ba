"""Async output rules 1, 2 and 7 and the sleep rules (docs/ARCHITECTURE.md), the worker's main
loop: control ACKs bypass the async path, drain before sleep, step execution without an output
thread, the worker's own packer, runner failures and cancellation between denoising steps.

Real multiprocessing queues, real threads, real packing into /dev/shm; the runner is a tiny real
class (tests/support/worker_harness.py).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from structlog.testing import capture_logs

from stagemesh.stage_service.transport import ipc, protocol
from tests.support.shm_guard import no_segment_left_behind, our_segments  # noqa: F401 - autouse fixture
from tests.support.worker_harness import (
    WAIT_S,
    GatedPacker,
    Harness,
    StubRunner,
    item,
)

# ---- point 2: ACKs bypass the async path; point 7: drain; ping does not wait ---------------------


def test_ping_ack_arrives_while_an_output_is_still_in_flight(harness_factory):
    packer = GatedPacker()
    h = harness_factory(packer=packer)
    h.send(protocol.Execute("rpc-1", [item(1)]))
    done = h.next_of(protocol.ComputeDone)  # COMPUTE_DONE at once, before packing finished
    assert packer.entered.wait(WAIT_S)
    h.send(protocol.Control("ctl-ping", "ping"))
    ack = h.next_of(protocol.Ack)  # not an OutputReady: the output is still held in the packer
    assert ack.rpc_id == "ctl-ping" and ack.error is None and ack.result["rank"] == 0
    assert h.worker.async_output.in_flight == 1 and not packer.release.is_set()
    assert not h.worker.async_output.draining.is_set(), "ping must not drain"
    packer.release.set()
    ready = h.next_of(protocol.OutputReady)
    assert ready.async_output_id == done.async_output_id
    ipc.unpack(ready.payload)


def test_drain_waits_for_in_flight_output_but_ping_does_not(harness_factory):
    packer = GatedPacker()
    h = harness_factory(packer=packer)
    thread = h.worker.async_output
    h.send(protocol.Execute("rpc-1", [item(1)]))
    done = h.next_of(protocol.ComputeDone)
    assert packer.entered.wait(WAIT_S)
    # A short drain times out and says so, in the Ack, while the output is pending.
    h.send(protocol.Control("ctl-d1", "drain", {"timeout_s": 0.05}))
    ack = h.next_of(protocol.Ack)
    assert ack.rpc_id == "ctl-d1" and ack.result == {"drained": False}
    # A long drain waits: it has started, the output is still held, no Ack yet.
    thread.draining.clear()
    h.send(protocol.Control("ctl-d2", "drain", {"timeout_s": WAIT_S}))
    assert thread.draining.wait(WAIT_S)
    assert h.results.empty() and thread.in_flight == 1
    packer.release.set()
    ready = h.next()
    assert isinstance(ready, protocol.OutputReady) and ready.async_output_id == done.async_output_id
    ack = h.next()
    assert isinstance(ack, protocol.Ack) and ack.rpc_id == "ctl-d2" and ack.result == {"drained": True}
    ipc.unpack(ready.payload)


def test_drain_control_answers_at_once_when_idle(harness_factory):
    h = harness_factory(packer=GatedPacker())
    h.send(protocol.Control("ctl-d", "drain", {"timeout_s": 0}))  # zero budget: only idle passes
    assert h.next_of(protocol.Ack).result == {"drained": True}


def test_sleep_drains_first_then_frees_the_weights(harness_factory):
    """Sleep (a memory-releasing call) waits for in-flight outputs before it frees anything;
    ping (above) does not wait."""
    packer = GatedPacker()
    h = harness_factory(packer=packer)
    assert "sleep" in h.worker._control_ops()
    weight = h.runner.net.weight
    assert weight.numel() == 64
    h.send(protocol.Execute("rpc-1", [item(1)]))
    done = h.next_of(protocol.ComputeDone)
    assert packer.entered.wait(WAIT_S)
    h.send(protocol.Control("ctl-sleep", "sleep", {"level": 1}))
    assert h.worker.async_output.draining.wait(WAIT_S)
    assert h.results.empty() and weight.numel() == 64  # not asleep yet: an output is still in flight
    packer.release.set()
    ready = h.next()
    assert isinstance(ready, protocol.OutputReady) and ready.async_output_id == done.async_output_id
    ack = h.next()
    assert isinstance(ack, protocol.Ack) and ack.rpc_id == "ctl-sleep" and ack.error is None, ack
    assert ack.result["level"] == 1 and ack.result["freed_bytes"] > 0
    assert weight.numel() == 0  # freed only after the output went out
    assert torch.equal(ipc.unpack(ready.payload)[0]["image"], torch.full((6,), 1.0))
    h.send(protocol.Control("ctl-wake", "wake"))
    assert h.next_of(protocol.Ack).error is None and weight.shape == (8, 8)


def test_a_worker_that_stops_gives_back_the_host_memory_sleep_holds(harness_factory):
    h = harness_factory()
    h.send(protocol.Control("ctl-sleep", "sleep", {"level": 1}))
    assert h.next_of(protocol.Ack).error is None
    assert h.worker.sleep.host_bytes > 0  # the level-1 copy of the weights
    h.send(protocol.Shutdown())
    h.thread.join(WAIT_S)
    assert not h.thread.is_alive()
    assert h.worker.sleep.host_bytes == 0 and h.worker.sleep.checkpoint_bytes == 0


def test_control_errors_come_back_as_acks(harness_factory):
    h = harness_factory()
    h.send(protocol.Control("ctl-x", "teleport"))
    ack = h.next_of(protocol.Ack)
    assert ack.rpc_id == "ctl-x" and "unknown control operation 'teleport'" in ack.error
    h.send(protocol.Control("ctl-y", "drain", {"bogus": 1}))
    ack = h.next_of(protocol.Ack)
    assert ack.rpc_id == "ctl-y" and ack.error and "TypeError" in ack.error
    h.send(protocol.Control("ctl-z", "ping"))
    assert h.next_of(protocol.Ack).error is None  # and the worker still serves


def test_shutdown_drains_pending_outputs_before_the_worker_exits():
    packer = GatedPacker()
    h = Harness(packer=packer)
    try:
        h.send(protocol.Execute("rpc-1", [item(5)]))
        done = h.next_of(protocol.ComputeDone)
        assert packer.entered.wait(WAIT_S)
        h.send(protocol.Shutdown())
        assert h.worker.async_output.draining.wait(WAIT_S)
        assert h.thread.is_alive()  # serve() is waiting for the output, not gone
        packer.release.set()
        h.thread.join(WAIT_S)
        assert not h.thread.is_alive()
        ready = h.next_of(protocol.OutputReady)
        assert ready.async_output_id == done.async_output_id
        assert torch.equal(ipc.unpack(ready.payload)[0]["image"], torch.full((6,), 5.0))
    finally:
        h.stop()


# ---- point 1: step execution runs the synchronous path, no background thread -----------------------


def test_step_execution_sends_results_and_starts_no_output_thread(harness_factory):
    before = {t.ident for t in threading.enumerate() if t.name == "async-output"}
    h = harness_factory(runner=StubRunner(numel=300_000), step_execution=True)  # 1.2 MB: via shm
    assert h.worker.async_output is None
    assert {t.ident for t in threading.enumerate() if t.name == "async-output"} == before
    h.send(protocol.Execute("rpc-s", [item(3), item(4)]))
    result = h.next_of(protocol.Result)
    assert result.rpc_id == "rpc-s" and len(result.outputs) == 2
    assert result.outputs[0]["image"].shm_name is not None
    outs = ipc.unpack(result.outputs)
    assert torch.equal(outs[1]["image"], torch.full((300_000,), 4.0))
    h.send(protocol.Control("ctl-d", "drain"))
    assert h.next_of(protocol.Ack).result == {"drained": True}


@pytest.mark.parametrize("step_execution", [False, True])
def test_workers_own_packer_leaves_nothing_once_its_rank_is_swept(step_execution):
    """With the worker's own packer (which may keep a few reusable slots per worker), every
    output still arrives intact, at most WORKER_POOL_SLOTS segments exist while the worker
    lives, and none survives the sweep the executor does when the worker stops."""
    before = our_segments()
    h = Harness(runner=StubRunner(numel=400_000), step_execution=step_execution, own_packer=True)
    try:
        seen = 0
        for n in range(6):
            h.send(protocol.Execute(f"rpc-{n}", [item(n), item(50 + n)]))
            msg = h.next_of(protocol.Result if step_execution else protocol.ComputeDone)
            payload = msg.outputs if step_execution else h.next_of(protocol.OutputReady).payload
            outs = ipc.unpack(payload)
            assert [o["seed"] for o in outs] == [n, 50 + n]
            assert torch.equal(outs[1]["image"], torch.full((400_000,), 50.0 + n))
            del outs
            seen = max(seen, len(our_segments() - before))
        assert seen <= max(getattr(ipc, "WORKER_POOL_SLOTS", 0), 2)
    finally:
        h.stop()
        ipc.sweep(os.getpid(), 0)  # what the executor does when this worker stops or dies
    assert our_segments() == before


def test_async_mode_starts_one_daemon_output_thread(harness_factory):
    h = harness_factory()
    t = h.worker.async_output._thread
    assert t.name == "async-output" and t.daemon and t.is_alive()


# ---- failures and cancellation on the worker's main loop -----------------------------------------------


def test_runner_failure_is_reported_and_the_worker_lives_on(harness_factory):
    h = harness_factory(runner=StubRunner(fail_on_seed=13))
    with capture_logs() as logged:
        h.send(protocol.Execute("rpc-bad", [item(13)]))
        failure = h.next_of(protocol.Failure)
    assert failure.rpc_id == "rpc-bad" and not failure.cancelled and "cursed" in failure.message
    # Logged as one structured event carrying the stack, not printed over the JSON log lines.
    assert [(e["event"], e["rpc_id"], e["exc_info"]) for e in logged if e["log_level"] == "error"] == [
        ("batch failed", "rpc-bad", True)
    ]
    h.send(protocol.Execute("rpc-ok", [item(2)]))
    assert h.next_of(protocol.ComputeDone).rpc_id == "rpc-ok"
    ipc.unpack(h.next_of(protocol.OutputReady).payload)


class SteppingRunner(StubRunner):
    """Waits for `go`, then runs up to `max_steps` (cheap) denoising steps, reporting each."""

    def __init__(self, max_steps: int = 200_000):
        super().__init__()
        self.max_steps = max_steps
        self.started = threading.Event()
        self.go = threading.Event()
        self.steps_run = 0

    def run(self, items, progress):
        self.started.set()
        assert self.go.wait(WAIT_S)
        for step in range(1, self.max_steps + 1):
            self.steps_run = step
            progress(step, self.max_steps)
        return [{"image": torch.zeros(1)} for _ in items]


def test_cancel_is_noticed_between_steps(harness_factory):
    runner = SteppingRunner()
    h = harness_factory(runner=runner)
    h.send(protocol.Execute("rpc-c", [item(1)]))
    assert runner.started.wait(WAIT_S)
    h.send(protocol.Cancel("rpc-other"))  # someone else's cancel: ignored
    h.send(protocol.Cancel("rpc-c"))
    runner.go.set()
    msg = h.next_of(protocol.Failure, timeout=30)
    assert msg.rpc_id == "rpc-c" and msg.cancelled and msg.message == "cancelled by the caller"
    assert runner.steps_run < runner.max_steps
    h.send(protocol.Control("ctl", "ping"))  # the worker serves on
    assert h.next_of(protocol.Ack).rpc_id == "ctl"

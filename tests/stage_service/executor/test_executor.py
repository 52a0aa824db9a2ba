"""Async output rules 5 and 6 (docs/ARCHITECTURE.md), executor side: the result pump's dispatch of every message kind
and cancelled-future races, on an executor and worker record as the pump sees them (the output
registry has its own tests in test_outputs.py; real pump threads and processes are in
test_executor_processes.py).

Real packing into /dev/shm; no process, no GPU, nothing faked.
"""

from __future__ import annotations

import pytest
import torch

from stagemesh.core import errors
from stagemesh.stage_service.executor.multiproc import Executor, WorkerProcess
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.transport import ipc, protocol
from tests.support.executor_parts import oid, packed_outputs, pend
from tests.support.shm_guard import no_segment_left_behind, our_segments  # noqa: F401 - autouse fixture

# ---- point 5: the pump's dispatch of every message kind --------------------------------------------


@pytest.fixture
def ex_worker():
    """An executor (not started) and a worker record, as the pump sees them."""
    ex = Executor(StageSettings(stage_id=1, kind="diffusion", model_dir="unused"))
    w = WorkerProcess(ex.groups[0].specs[0], process=None, requests=None, results=None)
    return ex, w


def test_dispatch_progress_calls_the_listener_and_keeps_the_rpc_pending(ex_worker):
    ex, w = ex_worker
    seen = []
    fut = pend(w, "r1", on_progress=lambda step, total: seen.append((step, total)))
    ex._dispatch(w, protocol.Progress("r1", 1, 3))
    ex._dispatch(w, protocol.Progress("r1", 2, 3))
    ex._dispatch(w, protocol.Progress("unknown", 1, 1))
    assert seen == [(1, 3), (2, 3)] and not fut.done() and "r1" in w.pending


def test_dispatch_a_failing_progress_listener_does_not_kill_the_pump(ex_worker):
    ex, w = ex_worker

    def bad(step, total):
        raise RuntimeError("Event loop is closed")

    fut = pend(w, "r1", on_progress=bad)
    ex._dispatch(w, protocol.Progress("r1", 1, 2))  # must not raise
    ex._dispatch(w, protocol.Failure("r1", "x"))
    assert isinstance(fut.exception(0), errors.StagemeshError)


def test_dispatch_compute_done_then_output_ready(ex_worker):
    ex, w = ex_worker
    fut = pend(w, "r1")
    msg = protocol.ComputeDone("r1", oid(7))
    ex._dispatch(w, msg)
    assert fut.result(0) is msg and "r1" not in w.pending
    subs = ex.outputs.split(oid(7), ["a", "b"])
    payload = packed_outputs(3, 4)
    names = {p["image"].shm_name for p in payload}
    assert names <= our_segments()
    ex._dispatch(w, protocol.OutputReady(oid(7), payload=payload))
    assert not (names & our_segments()), "unpacked (and unlinked) by the pump"
    a, b = (ex.outputs.future(s).result(0) for s in subs)
    assert torch.equal(a["image"], torch.full((300_000,), 3.0)) and torch.equal(b["image"], torch.full((300_000,), 4.0))
    assert ex.outputs.is_empty()


def test_dispatch_output_ready_with_an_error(ex_worker):
    ex, w = ex_worker
    pend(w, "r1")
    ex._dispatch(w, protocol.ComputeDone("r1", oid(8)))
    [sub] = ex.outputs.split(oid(8), ["a"])
    ex._dispatch(w, protocol.OutputReady(oid(8), error="RuntimeError: packing exploded"))
    with pytest.raises(
        errors.StagemeshError, match=r"stage 1 \(diffusion\): output failed: RuntimeError: packing exploded"
    ):
        ex.outputs.future(sub).result(0)
    assert ex.outputs.is_empty()


def test_dispatch_output_ready_with_an_unreadable_payload_fails_the_request_and_frees_the_rest(ex_worker):
    ex, w = ex_worker
    pend(w, "r1")
    ex._dispatch(w, protocol.ComputeDone("r1", oid(9)))
    [sub_a, sub_b] = ex.outputs.split(oid(9), ["a", "b"])
    payload = packed_outputs(1, 2)
    ipc.unlink_segment(payload[0]["image"].shm_name)  # e.g. swept by someone
    ex._dispatch(w, protocol.OutputReady(oid(9), payload=payload))
    for s in (sub_a, sub_b):
        with pytest.raises(errors.StagemeshError, match="could not unpack output"):
            ex.outputs.future(s).result(0)
    assert not ({payload[1]["image"].shm_name} & our_segments())
    assert ex.outputs.is_empty()


def test_dispatch_ack_and_ack_error(ex_worker):
    ex, w = ex_worker
    ok, bad = pend(w, "c1"), pend(w, "c2")
    ex._dispatch(w, protocol.Ack("c1", result={"drained": True}))
    ex._dispatch(w, protocol.Ack("c2", error="unknown control operation 'x'"))
    assert ok.result(0) == {"drained": True}
    with pytest.raises(errors.StagemeshError, match=r"stage 1 \(diffusion\) worker 0: unknown control operation 'x'"):
        bad.result(0)
    assert not w.pending


def test_dispatch_result_step_mode(ex_worker):
    ex, w = ex_worker
    fut = pend(w, "r1")
    payload = packed_outputs(5, 6)
    ex._dispatch(w, protocol.Result("r1", payload))
    out = fut.result(0)
    assert [o["image"][0].item() for o in out] == [5.0, 6.0]
    assert not ({p["image"].shm_name for p in payload} & our_segments())


def test_forward_pass_device_time_from_outputs_and_results_adds_up(ex_worker):
    ex, w = ex_worker
    pend(w, "r1")
    ex._dispatch(w, protocol.ComputeDone("r1", oid(8)))
    ex._dispatch(w, protocol.OutputReady(oid(8), payload=packed_outputs(1, big=False), compute_seconds=0.5))
    pend(w, "r2")
    ex._dispatch(w, protocol.Result("r2", packed_outputs(2, big=False), compute_seconds=0.25))
    ex._dispatch(w, protocol.OutputReady(oid(9), error="boom", compute_seconds=0.125))
    assert ex.compute_seconds == 0.875
    ex.outputs.discard(oid(8))
    ex.outputs.discard(oid(9))
    assert ex.outputs.is_empty()


def test_dispatch_result_with_an_unreadable_payload_fails_the_rpc_not_the_pump(ex_worker):
    ex, w = ex_worker
    fut = pend(w, "r1")
    payload = packed_outputs(5, 6)
    ipc.unlink_segment(payload[0]["image"].shm_name)
    ex._dispatch(w, protocol.Result("r1", payload))
    with pytest.raises(errors.StagemeshError, match="could not unpack result"):
        fut.result(0)
    assert not ({payload[1]["image"].shm_name} & our_segments())


def test_dispatch_failure_and_cancelled_failure(ex_worker):
    ex, w = ex_worker
    failed, cancelled = pend(w, "r1"), pend(w, "r2")
    ex._dispatch(w, protocol.Failure("r1", "ValueError: bad size"))
    ex._dispatch(w, protocol.Failure("r2", "cancelled by the caller", cancelled=True))
    # What failed, in words: the worker's own message (an exception class, maybe a batch-mate's id) is logged.
    with pytest.raises(errors.StagemeshError, match=r"stage 1 \(diffusion\) failed to run a batch") as info:
        failed.result(0)
    assert not isinstance(info.value, errors.Cancelled)
    with pytest.raises(errors.Cancelled, match="cancelled by the caller"):
        cancelled.result(0)
    assert not w.pending


def test_dispatch_messages_for_unknown_rpcs_are_ignored(ex_worker):
    ex, w = ex_worker
    for msg in (
        protocol.Ack("nope"),
        protocol.Result("nope", []),
        protocol.Failure("nope", "x"),
        protocol.ComputeDone("nope", oid(11)),
    ):
        ex._dispatch(w, msg)
    # An output whose RPC nobody waits for is dropped when it arrives.
    ex._dispatch(w, protocol.OutputReady(oid(11), payload=packed_outputs(1)))
    assert ex.outputs.is_empty(), ex.outputs.pending_summary()


# ---- point 5: cancelled-future races ------------------------------------------------------------------


def test_race_rpc_future_cancelled_before_compute_done(ex_worker):
    ex, w = ex_worker
    fut = pend(w, "r1")
    assert fut.cancel()  # the caller gave up before COMPUTE_DONE arrived
    ex._dispatch(w, protocol.ComputeDone("r1", oid(20)))  # must not raise
    payload = packed_outputs(1, 2)
    ex._dispatch(w, protocol.OutputReady(oid(20), payload=payload))
    assert not ({p["image"].shm_name for p in payload} & our_segments())
    assert ex.outputs.is_empty(), ex.outputs.pending_summary()
    assert not w.pending


def test_race_output_future_cancelled_before_output_ready(ex_worker):
    ex, w = ex_worker
    pend(w, "r1")
    ex._dispatch(w, protocol.ComputeDone("r1", oid(21)))
    subs = ex.outputs.split(oid(21), ["a", "b"])
    fa, fb = ex.outputs.future(subs[0]), ex.outputs.future(subs[1])
    assert fa.cancel()  # the waiter went away without telling the registry
    ex._dispatch(w, protocol.OutputReady(oid(21), payload=packed_outputs(1, 2)))
    assert fa.cancelled() and fb.result(0)["image"][0].item() == 2.0
    assert ex.outputs.is_empty(), ex.outputs.pending_summary()


def test_race_single_output_future_cancelled_before_output_ready(ex_worker):
    ex, w = ex_worker
    pend(w, "r1")
    ex._dispatch(w, protocol.ComputeDone("r1", oid(22)))
    fut = ex.outputs.future(oid(22))
    fut.cancel()
    ex._dispatch(w, protocol.OutputReady(oid(22), error="late failure"))  # error path too
    assert ex.outputs.is_empty()


def test_race_sub_future_cancelled_before_a_late_split_resolves_it(ex_worker):
    ex, w = ex_worker
    pend(w, "r1")
    ex._dispatch(w, protocol.ComputeDone("r1", oid(23)))
    ex._dispatch(w, protocol.OutputReady(oid(23), payload=packed_outputs(1, 2, big=False)))  # before the split
    early = ex.outputs.future(f"{oid(23)}/a")  # a waiter asks before the split exists ...
    early.cancel()  # ... and gives up
    subs = ex.outputs.split(oid(23), ["a", "b"])  # the split resolves a cancelled future: no raise
    assert early.cancelled()
    assert ex.outputs.future(subs[1]).result(0)["image"][0].item() == 2.0
    assert ex.outputs.is_empty(), ex.outputs.pending_summary()

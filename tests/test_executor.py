"""DESIGN §4.1 points 5, 6, 8 and 9, executor side: the result pump's dispatch of every message
kind, cancelled-future races, a dead worker, shutdown (the output registry it uses has its own
tests in test_outputs.py).

Real threads, real multiprocessing queues and processes, real /dev/shm; the last group runs a
real worker process on the real tiny model. No GPU, nothing faked.
"""


from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from stage_service import executor as executor_mod
from stage_service import ipc, protocol
from stage_service.executor import Executor, _Pending, _Worker
from stagemesh import errors
from tests.shm_guard import no_segment_left_behind, our_segments  # noqa: F401 - autouse fixture

WAIT_S = 10.0


def oid(n: int) -> str:
    return f"{n:032x}"


# ---- point 5: the pump's dispatch of every message kind --------------------------------------------

@pytest.fixture
def ex_worker():
    """An executor (not started) and a worker record, as the pump sees them."""
    ex = Executor(1, "diffusion", "unused", "cpu", workers=1)
    w = _Worker(ex._specs[0], process=None, requests=None, results=None)
    return ex, w


def pend(w: _Worker, rpc_id: str, on_progress=None) -> cf.Future:
    fut: cf.Future = cf.Future()
    w.pending[rpc_id] = _Pending(fut, on_progress)
    return fut


def packed_outputs(*seeds: int, big: bool = True, rank: int = 0):
    """What a worker sends: one packed dict per batch item (big ones via shared memory)."""
    n = 300_000 if big else 3
    return ipc.Packer(os.getpid(), rank).pack([{"image": torch.full((n,), float(s))} for s in seeds])


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
    with pytest.raises(errors.StagemeshError, match=r"stage 1 \(diffusion\): output failed: RuntimeError: packing exploded"):
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
    ex._dispatch(w, protocol.OutputReady(oid(8), payload=packed_outputs(1, big=False),
                                         compute_seconds=0.5))
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
    with pytest.raises(errors.StagemeshError, match=r"stage 1 \(diffusion\) failed: ValueError: bad size") as info:
        failed.result(0)
    assert not isinstance(info.value, errors.Cancelled)
    with pytest.raises(errors.Cancelled, match="cancelled by the caller"):
        cancelled.result(0)
    assert not w.pending


def test_dispatch_messages_for_unknown_rpcs_are_ignored(ex_worker):
    ex, w = ex_worker
    for msg in (protocol.Ack("nope"), protocol.Result("nope", []), protocol.Failure("nope", "x"),
                protocol.ComputeDone("nope", oid(11))):
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


def test_race_cancel_storm_against_a_real_pump_thread():
    """A real pump thread reads a real queue while the test cancels RPC and output futures."""
    ex = Executor(1, "diffusion", "unused", "cpu", workers=1)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=time.sleep, args=(120,), daemon=True)
    proc.start()
    results = ctx.Queue()
    w = _Worker(ex._specs[0], proc, ctx.Queue(), results)
    n = 60
    rpc_futs = [pend(w, f"r{i}") for i in range(n)]
    pump = threading.Thread(target=ex._pump, args=(w,), daemon=True)
    pump.start()
    try:
        for i in range(n):
            if i % 3 == 0:
                rpc_futs[i].cancel()
            results.put(protocol.ComputeDone(f"r{i}", oid(100 + i)))
        kept = {}
        for i in range(n):
            if i % 3:
                assert rpc_futs[i].result(WAIT_S).async_output_id == oid(100 + i)
                subs = ex.outputs.split(oid(100 + i), ["only"])
                f = ex.outputs.future(subs[0])
                if i % 3 == 1:
                    f.cancel()
                else:
                    kept[i] = f
            results.put(protocol.OutputReady(oid(100 + i), payload=packed_outputs(i, big=i % 4 == 0)))
        last = ex.outputs.future(oid(999))
        results.put(protocol.OutputReady(oid(999), payload=[]))  # a marker: everything before is dispatched
        assert last.result(WAIT_S) == []
        assert pump.is_alive()
        assert all(rpc_futs[i].cancelled() for i in range(0, n, 3))
        assert {i: f.result(0)["image"][0].item() for i, f in kept.items()} == {i: float(i) for i in kept}
        assert ex.outputs.is_empty(), ex.outputs.pending_summary()
    finally:
        proc.kill()
        pump.join(WAIT_S)
        results.close()
        w.requests.close()
    assert not pump.is_alive()


def test_real_pump_notices_a_dead_process_and_fails_everything_it_owed():
    deaths = []
    died = threading.Event()

    def on_death(rank, why):
        deaths.append((rank, why))
        died.set()

    ex = Executor(1, "diffusion", "unused", "cpu", workers=1, on_death=on_death)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=time.sleep, args=(120,), daemon=True)
    proc.start()
    w = _Worker(ex._specs[0], proc, ctx.Queue(), ctx.Queue())
    ex._workers[0] = w
    pump = threading.Thread(target=ex._pump, args=(w,), daemon=True)
    pump.start()
    try:
        _, fut = ex.submit(0, [{"request_id": "r", "prompt": "p", "width": 16, "height": 16,
                                "num_inference_steps": 1, "guidance_scale": 1.0, "seed": 1, "inputs": {}}])
        ctl = ex.control(0, "ping")
        w.results.put(protocol.ComputeDone("other", oid(1)))  # an output this worker still owes
        ex.outputs.expect(oid(2), 0)
        owed = ex.outputs.future(oid(2))
        orphan = ipc.Packer(os.getpid(), 0).pack(torch.zeros(1_000_001, dtype=torch.uint8))
        assert orphan.shm_name in our_segments()
        proc.kill()
        t0 = time.monotonic()
        for f in (fut, ctl, owed):
            exc = f.exception(5)
            assert isinstance(exc, errors.Unavailable), exc
            assert "stage 1 (diffusion) worker 0 died" in str(exc)
        assert time.monotonic() - t0 < 5
        assert died.wait(5)
        pump.join(WAIT_S)
        assert not pump.is_alive()
        assert deaths[0][0] == 0 and "died" in deaths[0][1]
        assert orphan.shm_name not in our_segments(), "the dead worker's segments are swept"
        assert ex.outputs.is_empty(), ex.outputs.pending_summary()
        # A dead worker takes no new work.
        _, late = ex.submit(0, [])
        assert isinstance(late.exception(0), errors.Unavailable)
    finally:
        proc.kill()
        w.results.close()
        w.requests.close()


def test_shutdown_closes_queues_and_fails_pending_even_when_the_request_queue_is_broken(monkeypatch):
    monkeypatch.setattr(executor_mod, "JOIN_TIMEOUT_S", 1.0)
    ex = Executor(1, "diffusion", "unused", "cpu", workers=1)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=time.sleep, args=(120,), daemon=True)  # ignores Shutdown
    proc.start()
    w = _Worker(ex._specs[0], proc, ctx.Queue(), ctx.Queue())
    ex._workers[0] = w
    w.pump = threading.Thread(target=ex._pump, args=(w,), daemon=True)
    w.pump.start()
    ctl = ex.control(0, "ping")
    ex.outputs.expect(oid(3), 0)
    out = ex.outputs.future(oid(3))
    w.requests.close()  # putting Shutdown will raise
    ex.shutdown()
    for f in (ctl, out):
        with pytest.raises(errors.Unavailable, match="executor shut down"):
            f.result(0)
    assert not proc.is_alive() and not w.pump.is_alive()
    with pytest.raises((OSError, ValueError)):
        w.results.get_nowait()  # closed
    assert ex.outputs.is_empty()
    _, fut = ex.submit(0, [])
    assert isinstance(fut.exception(0), errors.Unavailable)


# ---- points 8 and 9 with a real worker process on the real tiny model ---------------------------------

@pytest.fixture(scope="module")
def tiny_model(model_dir) -> Path:
    from stage_service.models.config import PipelineConfig
    from stage_service.models.weights import ensure_model_dir

    return ensure_model_dir(Path(model_dir), PipelineConfig.tiny())


def diffusion_item(seed: int, size: int, steps: int, cond_dim: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"request_id": f"req-{seed}", "prompt": "a lighthouse", "width": size, "height": size,
                "num_inference_steps": steps, "guidance_scale": 4.0, "seed": seed,
                "inputs": {"hidden_states": torch.randn(5, cond_dim, generator=g)}}


def run_one(ex: Executor, item: dict) -> torch.Tensor:
    _, fut = ex.submit(0, [item])
    done = fut.result(60)
    assert isinstance(done, protocol.ComputeDone) and len(done.async_output_id) == 32
    [sub] = ex.outputs.split(done.async_output_id, [item["request_id"]])
    return ex.outputs.wait_output_ready(sub, timeout_s=60)["image"]


def test_real_worker_death_restart_and_shutdown(tiny_model, monkeypatch):
    deaths = []
    died = threading.Event()

    def on_death(rank, why):
        deaths.append(why)
        died.set()

    ex = Executor(1, "diffusion", str(tiny_model), "cpu", workers=1, threads=1, on_death=on_death)
    try:
        [ready] = ex.start(timeout_s=120)
        cond_dim = ready.limits["cond_dim"]

        # A long request; kill the worker once it is surely computing.
        stepping = threading.Event()
        _, fut = ex.submit(0, [diffusion_item(1, 256, 50, cond_dim)], on_progress=lambda s, t: stepping.set())
        ex.outputs.expect(oid(77), 0)  # and an output it still owes
        owed = ex.outputs.future(oid(77))
        assert stepping.wait(60)
        pid = ex._workers[0].process.pid
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        exc = fut.exception(5)
        assert time.monotonic() - t0 < 5
        assert isinstance(exc, errors.Unavailable) and "stage" in str(exc) and "died" in str(exc), exc
        assert isinstance(owed.exception(5), errors.Unavailable)
        assert died.wait(5)  # the stage is told, so it can restart the worker
        assert len(deaths) == 1 and "stage 1 (diffusion) worker 0" in deaths[0]

        # The stage restarts it and serves again.
        ex.restart(0, timeout_s=120)
        assert ex._workers[0].process.pid != pid
        image = run_one(ex, diffusion_item(2, 32, 2, cond_dim))
        assert image.shape == (32, 32, 3) and image.dtype == torch.float32
        assert torch.equal(image, run_one(ex, diffusion_item(2, 32, 2, cond_dim)))  # deterministic
        assert ex.control(0, "ping").result(30)["rank"] == 0
        assert ex.control(0, "drain").result(30) == {"drained": True}

        # Restarting a live worker fails what it still owed at once (nobody waits 600 s).
        ex.outputs.expect(oid(78), 0)
        owed = ex.outputs.future(oid(78))
        ex.restart(0, timeout_s=120)
        assert isinstance(owed.exception(5), errors.Unavailable)
        assert ex.outputs.is_empty(), ex.outputs.pending_summary()

        # Shutdown: a request stuck in a frozen worker and a waited-for output both fail.
        monkeypatch.setattr(executor_mod, "JOIN_TIMEOUT_S", 2.0)
        w = ex._workers[0]
        os.kill(w.process.pid, signal.SIGSTOP)
        _, stuck = ex.submit(0, [diffusion_item(3, 32, 1, cond_dim)])
        ex.outputs.expect(oid(79), 0)
        waiting = ex.outputs.future(oid(79))
    except BaseException:
        ex.shutdown()
        raise
    ex.shutdown()
    for f in (stuck, waiting):
        with pytest.raises(errors.Unavailable, match="executor shut down"):
            f.result(0)
    assert not w.process.is_alive() and not w.pump.is_alive()
    assert ex.outputs.is_empty()
    assert len(deaths) == 1  # a shutdown is not a death

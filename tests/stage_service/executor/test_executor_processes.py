"""Async output rules 5, 8 and 9 (docs/ARCHITECTURE.md) with real threads and processes: a result pump reading a real
result pipe while futures are cancelled, a dead worker process, shutdown with a broken request
queue, and a real worker process on the real tiny model (death, restart, shutdown).

No GPU, nothing faked.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from stagemesh.core import errors
from stagemesh.core.params import Params
from stagemesh.stage_service.executor import multiproc as executor_mod
from stagemesh.stage_service.executor.multiproc import Executor, WorkerProcess
from stagemesh.stage_service.models.contract import WorkItem
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.transport import ipc, protocol
from stagemesh.stage_service.transport.result_pipe import result_pipe
from tests.support.executor_parts import WAIT_S, oid, packed_outputs, pend
from tests.support.shm_guard import no_segment_left_behind, our_segments  # noqa: F401 - autouse fixture


def _settings(**values) -> StageSettings:
    return StageSettings(**{"stage_id": 1, "kind": "diffusion", "model_dir": "unused", **values})


def test_race_cancel_storm_against_a_real_pump_thread():
    """A real pump thread reads a real result pipe while the test cancels RPC and output futures."""
    ex = Executor(_settings())
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=time.sleep, args=(120,), daemon=True)
    proc.start()
    receiver, results = result_pipe(ctx)  # the test writes what a worker would
    w = WorkerProcess(ex.groups[0].specs[0], proc, ctx.Queue(), receiver)
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
        receiver.close()
        w.requests.close()
    assert not pump.is_alive()


def test_real_pump_notices_a_dead_process_and_fails_everything_it_owed():
    deaths = []
    died = threading.Event()

    def on_death(rank, why):
        deaths.append((rank, why))
        died.set()

    ex = Executor(_settings(), on_death=on_death)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=time.sleep, args=(120,), daemon=True)
    proc.start()
    receiver, sender = result_pipe(ctx)  # we keep a sender: the death shows by the process alone
    w = WorkerProcess(ex.groups[0].specs[0], proc, ctx.Queue(), receiver)
    ex.groups[0].workers = [w]
    pump = threading.Thread(target=ex._pump, args=(w,), daemon=True)
    pump.start()
    try:
        _, fut = ex.submit(0, [WorkItem("r", Params("p", 16, 16, 1, 1.0, 1, "tensor"))])
        ctl = ex.control(0, "ping")
        sender.put(protocol.ComputeDone("other", oid(1)))  # an output this worker still owes
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
        sender.close()
        w.results.close()
        w.requests.close()


def _hold_and_sleep(sender, seconds: float) -> None:
    time.sleep(seconds)  # holds the only sender, as a worker between two messages


def test_a_dead_worker_ends_its_result_pipe_and_the_pump_fails_pending_without_polling(monkeypatch):
    # A poll interval far above the 5 s budget: only the pipe's end of stream can be in time.
    monkeypatch.setattr(executor_mod, "PUMP_POLL_S", 60.0)
    died = threading.Event()
    ex = Executor(_settings(), on_death=lambda *_: died.set())
    ctx = mp.get_context("spawn")
    receiver, sender = result_pipe(ctx)
    proc = ctx.Process(target=_hold_and_sleep, args=(sender, 120), daemon=True)
    proc.start()
    sender.close()  # as worker_startup.spawn does
    w = WorkerProcess(ex.groups[0].specs[0], proc, ctx.Queue(), receiver)
    ex.groups[0].workers = [w]
    pump = threading.Thread(target=ex._pump, args=(w,), daemon=True)
    pump.start()
    try:
        ctl = ex.control(0, "ping")
        proc.kill()
        assert isinstance(ctl.exception(5), errors.Unavailable)
        assert died.wait(5)
        pump.join(5)
        assert not pump.is_alive()
    finally:
        proc.kill()
        receiver.close()
        w.requests.close()


def test_shutdown_closes_queues_and_fails_pending_even_when_the_request_queue_is_broken(monkeypatch):
    monkeypatch.setattr(executor_mod, "JOIN_TIMEOUT_S", 1.0)
    ex = Executor(_settings())
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=time.sleep, args=(120,), daemon=True)  # ignores Shutdown
    proc.start()
    receiver, sender = result_pipe(ctx)
    w = WorkerProcess(ex.groups[0].specs[0], proc, ctx.Queue(), receiver)
    ex.groups[0].workers = [w]
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
        w.results.get(timeout=0)  # closed
    sender.close()
    assert ex.outputs.is_empty()
    _, fut = ex.submit(0, [])
    assert isinstance(fut.exception(0), errors.Unavailable)


def _stops_with_its_peer(up, requests, mine, peer) -> None:
    """A stand-in worker: on Shutdown it exits 0, but only once its peer was told to stop too."""
    up.set()
    assert isinstance(requests.get(timeout=60), protocol.Shutdown)
    mine.set()
    os._exit(0 if peer.wait(30) else 3)


def test_shutdown_tells_every_worker_before_joining_any(monkeypatch):
    monkeypatch.setattr(executor_mod, "JOIN_TIMEOUT_S", 2.0)  # one at a time: the first is killed
    ex = Executor(_settings(workers=2))
    ctx = mp.get_context("spawn")
    up, told = [ctx.Event(), ctx.Event()], [ctx.Event(), ctx.Event()]
    workers = []
    for i, g in enumerate(ex.groups):
        requests = ctx.Queue()
        proc = ctx.Process(target=_stops_with_its_peer, args=(up[i], requests, told[i], told[1 - i]), daemon=True)
        proc.start()
        receiver, sender = result_pipe(ctx)
        sender.close()
        g.workers = [WorkerProcess(g.specs[0], proc, requests, receiver, group=i)]
        workers.append(g.workers[0])
    assert all(event.wait(60) for event in up)
    ex.shutdown()
    assert [w.process.exitcode for w in workers] == [0, 0]


# ---- points 8 and 9 with a real worker process on the real tiny model ---------------------------------


def diffusion_item(seed: int, size: int, steps: int, cond_dim: int) -> WorkItem:
    g = torch.Generator().manual_seed(seed)
    params = Params("a lighthouse", size, size, steps, 4.0, seed, "tensor")
    return WorkItem(f"req-{seed}", params, {"hidden_states": torch.randn(5, cond_dim, generator=g)})


def run_one(ex: Executor, item: WorkItem) -> torch.Tensor:
    _, fut = ex.submit(0, [item])
    done = fut.result(60)
    assert isinstance(done, protocol.ComputeDone) and len(done.async_output_id) == 32
    [sub] = ex.outputs.split(done.async_output_id, [item.request_id])
    return ex.outputs.wait_output_ready(sub, timeout_s=60)["image"]


def test_real_worker_death_restart_and_shutdown(tiny_model, monkeypatch):
    deaths = []
    died = threading.Event()

    def on_death(rank, why):
        deaths.append(why)
        died.set()

    ex = Executor(_settings(model_dir=str(tiny_model), threads=1), on_death=on_death)
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
        assert ex.control(0, "ping").result(30)[0]["rank"] == 0
        assert ex.control(0, "drain").result(30) == {0: {"drained": True}}

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

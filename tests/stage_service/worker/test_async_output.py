"""Async output rules 2, 3, 5, 7 (docs/ARCHITECTURE.md), worker side: output ids, ResultWriter (one writer at a time),
AsyncOutputThread (copy, pack, drain, failures, the device-time report) and the order of stream
and event operations.

Real result pipes and queues, real threads, real packing into /dev/shm. The only fake is the GPU
in the stream/event ordering test.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import ClassVar

import pytest
import torch
from structlog.testing import capture_logs

from stagemesh.stage_service import platform
from stagemesh.stage_service.transport import ipc, protocol
from stagemesh.stage_service.transport.result_pipe import result_pipe
from stagemesh.stage_service.worker import async_output
from stagemesh.stage_service.worker.async_output import AsyncOutputThread, ResultWriter, new_output_id
from tests.support.shm_guard import no_segment_left_behind, our_segments  # noqa: F401 - autouse fixture
from tests.support.worker_harness import (
    CTX,
    HEX32,
    WAIT_S,
    GatedPacker,
    Harness,
    ObservedOutputThread,
    StubRunner,
    item,
)

# ---- point 2: output ids -------------------------------------------------------------------------


def test_new_output_ids_are_unique_32_hex():
    ids = [new_output_id() for _ in range(20_000)]
    assert all(HEX32.match(i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_worker_compute_done_ids_are_unique_32_hex_and_match_output_ready(harness_factory):
    h = harness_factory()
    for n in range(20):
        h.send(protocol.Execute(f"rpc-{n}", [item(n), item(100 + n)]))
    done, ready = {}, {}
    while len(done) < 20 or len(ready) < 20:
        msg = h.next()
        if isinstance(msg, protocol.ComputeDone):
            done[msg.rpc_id] = msg.async_output_id
        elif isinstance(msg, protocol.OutputReady):
            assert msg.error is None
            ready[msg.async_output_id] = [ipc.unpack(o) for o in msg.payload]
    assert all(HEX32.match(i) for i in done.values()) and len(set(done.values())) == 20
    assert set(ready) == set(done.values())
    for n in range(20):
        outs = ready[done[f"rpc-{n}"]]
        assert [o["seed"] for o in outs] == [n, 100 + n]  # one packed dict per batch item, in order
        assert torch.equal(outs[1]["image"], torch.full((6,), 100.0 + n))


# ---- point 3: one writer at a time ----------------------------------------------------------------


class OverlapDetectingQueue:
    """A queue whose put() notices a second thread entering while one is inside: on entry it
    waits (briefly) at a two-party barrier, which only trips if another put runs concurrently."""

    def __init__(self, window_s: float):
        self.barrier = threading.Barrier(2)
        self.window_s = window_s
        self.overlaps = 0
        self.items = []

    def put(self, message):
        try:
            self.barrier.wait(timeout=self.window_s)
            self.overlaps += 1
        except threading.BrokenBarrierError:
            pass
        finally:
            if self.barrier.broken:
                self.barrier.reset()
        self.items.append(message)


class _UnlockedWriter:
    """Control for the detector: what a writer without a lock would do."""

    def __init__(self, results):
        self._results = results

    def put(self, message):
        self._results.put(message)


def _hammer(writer, n: int) -> list[threading.Thread]:
    start = threading.Barrier(2)

    def run(tid):
        start.wait()
        for i in range(n):
            writer.put((tid, i))

    threads = [threading.Thread(target=run, args=(tid,)) for tid in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return threads


def test_result_writer_admits_one_writer_at_a_time():
    fake = OverlapDetectingQueue(window_s=0.02)
    _hammer(ResultWriter(fake), 10)
    assert fake.overlaps == 0
    assert sorted(fake.items) == [(tid, i) for tid in range(2) for i in range(10)]
    # The detector does catch concurrent writers (so the check above can fail). A wide window:
    # it costs nothing here, the barrier trips as soon as the second writer is inside too.
    control = OverlapDetectingQueue(window_s=1.0)
    _hammer(_UnlockedWriter(control), 10)
    assert control.overlaps > 0


def test_result_writer_holds_its_lock_while_writing():
    seen = []

    class LockSpy:
        def put(self, message):
            seen.append(writer._lock.locked())

    writer = ResultWriter(LockSpy())
    writer.put("x")
    assert seen == [True] and not writer._lock.locked()


def test_two_threads_hammering_a_real_result_pipe_lose_and_mangle_nothing():
    # Messages far above PIPE_BUF (4 KiB): unserialized writers would interleave their bytes.
    receiver, sender = result_pipe(CTX)
    writer = ResultWriter(sender)
    n = 200
    payload = {tid: bytes([65 + tid]) * 200_000 for tid in range(2)}
    start = threading.Barrier(2)

    def run(tid):
        start.wait()
        for i in range(n):
            writer.put(protocol.Progress(f"{tid}:{i}:" + payload[tid].decode(), i, n))

    threads = [threading.Thread(target=run, args=(tid,)) for tid in range(2)]
    for t in threads:
        t.start()
    got = [receiver.get(timeout=WAIT_S) for _ in range(2 * n)]  # read while they write
    for t in threads:
        t.join(30)
    sender.close()
    receiver.close()
    per_thread = {0: [], 1: []}
    for msg in got:
        tid, i, body = msg.rpc_id.split(":", 2)
        assert body.encode() == payload[int(tid)], "message mangled"
        assert msg.step == int(i)
        per_thread[int(tid)].append(int(i))
    assert per_thread == {0: list(range(n)), 1: list(range(n))}  # complete and in each writer's order


# ---- point 4: a batch's storage comes over in one copy (the grouping, on CPU tensors) ---------------


def test_slices_that_cover_their_storage_are_grouped_and_rebuilt_from_one_copy():
    batch = torch.rand(4, 3, 8, 8).permute(0, 2, 3, 1)  # a batch seen channels-last, 4 slices
    lone = torch.rand(100, 10)[:2]  # a small view of a bigger storage
    pair = torch.rand(6).view(2, 3)
    slices = list(batch)
    groups = async_output.covering_groups([*slices, lone, pair[0]])
    # One group, the batch's: not the lone view, not half of `pair`.
    assert [[id(t) for t in views] for views in groups.values()] == [[id(t) for t in slices]]
    assert async_output.covering_groups([pair[0], pair[1]])  # both halves do cover it
    copy = async_output.storage_bytes(batch).clone()  # what the device->host copy lands in
    assert copy.numel() == batch.numel() * 4
    rebuilt = [async_output.same_view(copy, t) for t in slices]
    for got, want in zip(rebuilt, slices):
        assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want)
    assert {t.untyped_storage().data_ptr() for t in rebuilt} == {copy.untyped_storage().data_ptr()}
    # So the packer sends each slice by the batch's storage but ships only its own bytes.
    assert all(ipc.goes_to_shm(t) for t in rebuilt) == ipc.goes_to_shm(batch)


# ---- points 3 and 7: the background thread and drain -----------------------------------------------


def _output_thread(packer) -> tuple[ObservedOutputThread, queue.Queue]:
    sink: queue.Queue = queue.Queue()
    return ObservedOutputThread("cpu", packer, ResultWriter(sink)), sink


def test_drain_returns_true_at_once_when_idle():
    t, _ = _output_thread(ipc.Packer(os.getpid(), 0))
    try:
        assert t.in_flight == 0
        assert t.drain(0) is True  # no waiting at all, even with a zero budget
    finally:
        t.close()


def test_drain_false_on_timeout_then_true_once_the_output_is_sent():
    packer = GatedPacker()
    t, sink = _output_thread(packer)
    try:
        t.submit("a" * 32, [{"x": torch.ones(3)}], platform.DeviceEvent("cpu").record())
        assert packer.entered.wait(WAIT_S)
        assert t.in_flight == 1
        with capture_logs() as logs:
            assert t.drain(0.05) is False
        assert any(
            e["event"] == "async output drain timed out" and e["log_level"] == "warning" and e["in_flight"] == 1
            for e in logs
        ), logs
        assert sink.empty()
        packer.release.set()
        assert t.drain(WAIT_S) is True
        assert t.in_flight == 0
        msg = sink.get_nowait()  # sent before drain returned
        assert isinstance(msg, protocol.OutputReady) and msg.error is None and msg.async_output_id == "a" * 32
        assert torch.equal(ipc.unpack(msg.payload)[0]["x"], torch.ones(3))
    finally:
        packer.release.set()
        t.close()


def test_a_failed_packing_sends_output_ready_with_an_error_and_the_thread_lives_on():
    packer = GatedPacker(fail=True)
    packer.release.set()
    t, sink = _output_thread(packer)
    try:
        t.submit("b" * 32, [{"x": torch.ones(2)}], platform.DeviceEvent("cpu"))
        msg = sink.get(timeout=WAIT_S)
        assert isinstance(msg, protocol.OutputReady) and msg.async_output_id == "b" * 32
        assert msg.payload is None and "RuntimeError" in msg.error and "packing exploded" in msg.error
        assert t.drain(WAIT_S) and t.in_flight == 0
        packer.fail = False
        t.submit("c" * 32, [{"x": torch.ones(2)}], platform.DeviceEvent("cpu"))
        ok = sink.get(timeout=WAIT_S)
        assert ok.error is None and torch.equal(ipc.unpack(ok.payload)[0]["x"], torch.ones(2))
    finally:
        t.close()


def test_a_half_packed_output_that_fails_leaves_no_segment():
    t, sink = _output_thread(ipc.Packer(os.getpid(), 0))
    try:
        before = our_segments()
        t.submit(
            "d" * 32,
            [{"big": torch.zeros(2_000_000, dtype=torch.uint8)}, {"bad": torch.empty(3, device="meta")}],
            platform.DeviceEvent("cpu"),
        )
        msg = sink.get(timeout=WAIT_S)
        assert msg.error is not None and msg.payload is None
        assert our_segments() == before
    finally:
        t.close()


class FakeGpuEvent:
    """FAKE GPU: stands in for a CUDA event so the ordering of stream operations is observable."""

    log: ClassVar[list] = []

    def __init__(self, device, timing=False, blocking=False):
        self.recorded = False
        self.timing, self.blocking = timing, blocking

    def record(self, stream=None):
        self.recorded = True
        FakeGpuEvent.log.append(("record", self, threading.current_thread().name))
        return self

    def seconds_since(self, start):
        assert self.timing and start.timing and self.recorded and start.recorded
        FakeGpuEvent.log.append(("elapsed", (start, self), threading.current_thread().name))
        return 0.25

    def synchronize(self):
        FakeGpuEvent.log.append(("event.synchronize", self, threading.current_thread().name))

    def query(self):
        return self.recorded

    raw = object()


class FakeGpuStream:
    """FAKE GPU: a side stream that logs what is asked of it."""

    def __init__(self, device):
        self.raw = object()
        self.device = device
        self.current = False

    def wait_event(self, event):
        assert self.current, "wait_event must be issued on the side stream"
        FakeGpuEvent.log.append(("wait_event", event, threading.current_thread().name))

    def synchronize(self):
        FakeGpuEvent.log.append(("stream.synchronize", self, threading.current_thread().name))

    def active(self):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self.current = True
            FakeGpuEvent.log.append(("enter side stream", self, threading.current_thread().name))
            try:
                yield
            finally:
                self.current = False
                FakeGpuEvent.log.append(("leave side stream", self, threading.current_thread().name))

        return cm()


class LoggingPacker(ipc.Packer):
    def pack(self, obj):
        FakeGpuEvent.log.append(("pack", None, threading.current_thread().name))
        return super().pack(obj)


def test_fake_gpu_event_recorded_after_forward_and_waited_on_by_the_side_stream(monkeypatch):
    """Only the GPU is faked (platform.DeviceEvent/Stream): the main thread records events before
    and after the forward pass and answers COMPUTE_DONE; the async-output thread makes its side
    stream wait on the second event, records a blocking event after the copies, leaves the
    stream, sleeps on that event, packs, and only then reads the forward pass's device time from
    the two events."""
    FakeGpuEvent.log = []
    monkeypatch.setattr(platform, "DeviceEvent", FakeGpuEvent)
    monkeypatch.setattr(platform, "Stream", FakeGpuStream)
    runner = StubRunner()
    runner.log = []
    h = Harness(runner=runner)
    try:
        h.worker.async_output.close()
        h.worker.async_output = AsyncOutputThread("cpu", LoggingPacker(os.getpid(), 0), h.worker.writer)
        h.send(protocol.Execute("rpc-gpu", [item(1)]))
        done = h.next_of(protocol.ComputeDone)
        ready = h.next_of(protocol.OutputReady)
        assert ready.async_output_id == done.async_output_id and ready.error is None
        assert ready.compute_seconds == 0.25  # the fake events' device time of the forward pass
        ipc.unpack(ready.payload)
    finally:
        h.stop()
    log = [(what, who, thread) for what, who, thread in FakeGpuEvent.log]
    names = [what for what, _, _ in log]
    assert names == [
        "record",
        "record",
        "enter side stream",
        "wait_event",
        "record",
        "leave side stream",
        "event.synchronize",
        "pack",
        "elapsed",
    ], names
    started, finished, wait, copied, waited, elapsed = (log[0], log[1], log[3], log[4], log[6], log[8])
    assert wait[1] is finished[1], "the side stream must wait on the event recorded after the forward"
    assert waited[1] is copied[1] and copied[1].blocking, (
        "the thread sleeps on a blocking event recorded after the copies, on the side stream"
    )
    assert elapsed[1] == (started[1], finished[1]), "timed from before the forward to after it"
    assert started[2] == finished[2] == "worker-main"
    assert runner.log == ["forward@worker-main"]
    assert {thread for _, _, thread in log[2:]} == {"async-output"}


class SlowRunner(StubRunner):
    """A forward pass that takes a known time (the CPU's device time is the host clock)."""

    def run(self, items, progress):
        time.sleep(0.05)
        return super().run(items, progress)


@pytest.mark.parametrize("step_execution", [False, True])
def test_each_output_reports_its_forward_passs_device_time(harness_factory, step_execution):
    h = harness_factory(runner=SlowRunner(), step_execution=step_execution)
    h.send(protocol.Execute("rpc-t", [item(1), item(2)]))
    if step_execution:
        reply = h.next_of(protocol.Result)
        ipc.unpack(reply.outputs)
    else:
        h.next_of(protocol.ComputeDone)
        reply = h.next_of(protocol.OutputReady)
        ipc.unpack(reply.payload)
    assert 0.05 <= reply.compute_seconds < 5.0

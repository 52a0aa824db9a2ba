"""DESIGN §4.1 points 1-3 and 7, worker side: ResultWriter, AsyncOutputThread, Worker ACKs/drain.

Real multiprocessing queues, real threads, real packing into /dev/shm. The runner is a tiny real
class defined here (no mock library). The only fake is the GPU in the stream/event ordering test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from structlog.testing import capture_logs

from stage_service import async_output, ipc, platform, protocol
from stage_service.async_output import AsyncOutputThread, ResultWriter, new_output_id
from stage_service.worker import Worker

from tests.shm_guard import no_segment_left_behind, our_segments  # noqa: F401 - autouse fixture

HEX32 = re.compile(r"^[0-9a-f]{32}$")
CTX = mp.get_context("spawn")
WAIT_S = 10.0


# ---- helpers: a tiny real runner, a packer that can be held, a worker on real queues -----------

class StubRunner:
    """Each item becomes {"image": a tensor filled with its seed} of `numel` float32 values."""

    def __init__(self, numel: int = 6, fail_on_seed: int | None = None):
        self.numel = numel
        self.fail_on_seed = fail_on_seed
        self.log: list[str] | None = None
        self.net = torch.nn.Linear(8, 8)  # a few real weights, for sleep

    def weight_files(self):
        from stage_service.sleep import WeightFile

        return [WeightFile(Path("/nonexistent/stub.safetensors"), {"": self.net})]

    def run(self, items, progress):
        out = []
        for i, item in enumerate(items):
            if item.seed == self.fail_on_seed:
                raise ValueError(f"seed {item.seed} is cursed")
            out.append({"image": torch.full((self.numel,), float(item.seed)), "seed": item.seed})
            progress(i + 1, len(items))
        if self.log is not None:
            self.log.append(f"forward@{threading.current_thread().name}")
        return out

    def limits(self):
        return {}


class GatedPacker:
    """Wraps the real packer; pack() blocks until `release` is set (so an output stays in flight)."""

    def __init__(self, fail: bool = False):
        self.inner = ipc.Packer(os.getpid(), 0)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = fail
        self.calls = 0

    def pack(self, obj):
        self.calls += 1
        self.entered.set()
        assert self.release.wait(WAIT_S), "test never released the packer"
        if self.fail:
            raise RuntimeError("packing exploded")
        return self.inner.pack(obj)


class ObservedOutputThread(AsyncOutputThread):
    """The real thread; tells the test when someone starts to drain it."""

    def __init__(self, *args, **kwargs):
        self.draining = threading.Event()
        super().__init__(*args, **kwargs)

    def drain(self, timeout_s: float = async_output.DRAIN_TIMEOUT_S) -> bool:
        self.draining.set()
        return super().drain(timeout_s)


def item(seed: int) -> dict:
    return {"request_id": f"req-{seed}", "prompt": "p", "width": 16, "height": 16, "num_inference_steps": 1,
                "guidance_scale": 1.0, "seed": seed, "inputs": {}}


class Harness:
    """A real Worker serving real multiprocessing queues on a thread of this process."""

    def __init__(self, runner=None, packer=None, step_execution: bool = False, own_packer: bool = False):
        self.requests, self.results = CTX.Queue(), CTX.Queue()
        spec = protocol.WorkerSpec(rank=0, stage_id=1, kind="diffusion", model_dir="", device="cpu",
                                   parent_pid=os.getpid(), step_execution=step_execution)
        self.runner = runner or StubRunner()
        self.worker = Worker(spec, self.runner, "cpu", self.requests, self.results)
        self.packer = packer
        if not own_packer:
            # A plain packer (one-shot segments, no reusable slot pool), so that every segment
            # must be gone once its reader unpacked it; the pooled default has its own test.
            self.worker.packer = ipc.Packer(os.getpid(), 0)
        if not step_execution and (packer is not None or not own_packer):
            self.worker.async_output.close()
            self.worker.async_output = ObservedOutputThread("cpu", packer or self.worker.packer, self.worker.writer)
        self.thread = threading.Thread(target=self.worker.serve, name="worker-main", daemon=True)
        self.thread.start()

    def send(self, msg) -> None:
        self.requests.put(msg)

    def next(self, timeout: float = WAIT_S):
        return self.results.get(timeout=timeout)

    def next_of(self, kind, timeout: float = WAIT_S):
        """Skip Progress messages."""
        while True:
            msg = self.next(timeout)
            if not isinstance(msg, protocol.Progress):
                assert isinstance(msg, kind), msg
                return msg

    def stop(self) -> None:
        if self.packer is not None:
            self.packer.release.set()
        self.send(protocol.Shutdown())
        self.thread.join(WAIT_S + 5)
        assert not self.thread.is_alive()
        leftovers = []
        while True:
            try:
                leftovers.append(self.results.get(timeout=0.05))
            except queue.Empty:
                break
        for msg in leftovers:  # unread outputs still own segments: read them as the executor would
            if isinstance(msg, protocol.OutputReady) and msg.payload is not None:
                ipc.unpack(msg.payload)
            if isinstance(msg, protocol.Result):
                ipc.unpack(msg.outputs)
        for q in (self.requests, self.results):
            q.close()
            q.join_thread()


@pytest.fixture
def harness_factory():
    made: list[Harness] = []

    def make(**kw) -> Harness:
        h = Harness(**kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.stop()


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


def test_two_threads_hammering_a_real_mp_queue_lose_and_mangle_nothing():
    q = CTX.Queue()
    writer = ResultWriter(q)
    n = 400
    payload = {tid: bytes([65 + tid]) * 20_000 for tid in range(2)}
    start = threading.Barrier(2)

    def run(tid):
        start.wait()
        for i in range(n):
            writer.put(protocol.Progress(f"{tid}:{i}:" + payload[tid].decode(), i, n))

    threads = [threading.Thread(target=run, args=(tid,)) for tid in range(2)]
    for t in threads:
        t.start()
    got = [q.get(timeout=WAIT_S) for _ in range(2 * n)]  # read while they write (pipes are small)
    for t in threads:
        t.join(30)
    q.close()
    q.join_thread()
    per_thread = {0: [], 1: []}
    for msg in got:
        tid, i, body = msg.rpc_id.split(":", 2)
        assert body.encode() == payload[int(tid)], "message mangled"
        assert msg.step == int(i)
        per_thread[int(tid)].append(int(i))
    assert per_thread == {0: list(range(n)), 1: list(range(n))}  # complete and in each writer's order


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
        assert any(e["event"] == "async output drain timed out" and e["log_level"] == "warning"
                   and e["in_flight"] == 1 for e in logs), logs
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
        t.submit("d" * 32, [{"big": torch.zeros(2_000_000, dtype=torch.uint8)},
                            {"bad": torch.empty(3, device="meta")}], platform.DeviceEvent("cpu"))
        msg = sink.get(timeout=WAIT_S)
        assert msg.error is not None and msg.payload is None
        assert our_segments() == before
    finally:
        t.close()


class FakeGpuEvent:
    """FAKE GPU: stands in for a CUDA event so the ordering of stream operations is observable."""

    log: ClassVar[list] = []

    def __init__(self, device, timing=False):
        self.recorded = False
        self.timing = timing

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
    stream wait on the second event, leaves the stream, synchronizes it, packs, and only then
    reads the forward pass's device time from the two events."""
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
    assert names == ["record", "record", "enter side stream", "wait_event", "leave side stream",
                     "stream.synchronize", "pack", "elapsed"], names
    started, finished, wait, elapsed = log[0], log[1], log[3], log[7]
    assert wait[1] is finished[1], "the side stream must wait on the event recorded after the forward"
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
    h.send(protocol.Execute("rpc-bad", [item(13)]))
    failure = h.next_of(protocol.Failure)
    assert failure.rpc_id == "rpc-bad" and not failure.cancelled and "cursed" in failure.message
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

"""The worker -> executor result pipe: whole messages in order, no helper thread in the sender,
room for an inline payload without a reader, and the end of the stream when the worker dies.
Real pipes, real spawned processes."""

from __future__ import annotations

import fcntl
import os
import queue
import threading
from pathlib import Path

import pytest

from stagemesh.stage_service.transport import protocol
from stagemesh.stage_service.transport.result_pipe import PIPE_BYTES, result_pipe
from tests.support.worker_harness import CTX, WAIT_S


def _send_then_exit(sender, count: int) -> None:
    for i in range(count):
        sender.put(protocol.Progress(f"r{i}", i, count))
    os._exit(3)  # no clean-up: as a worker killed after its last message


def test_messages_arrive_in_order_and_a_dead_sender_ends_the_stream():
    receiver, sender = result_pipe(CTX)
    proc = CTX.Process(target=_send_then_exit, args=(sender, 5))
    proc.start()
    sender.close()  # as the executor does once the worker runs
    try:
        got = [receiver.get(timeout=WAIT_S) for _ in range(5)]
        assert [(m.rpc_id, m.step) for m in got] == [(f"r{i}", i) for i in range(5)]
        with pytest.raises(EOFError):
            receiver.get(timeout=WAIT_S)
    finally:
        proc.join(WAIT_S)
        receiver.close()
    assert proc.exitcode == 3


def test_get_times_out_with_queue_empty_while_the_sender_lives():
    receiver, sender = result_pipe(CTX)
    try:
        assert receiver.empty()
        with pytest.raises(queue.Empty):
            receiver.get(timeout=0.05)
    finally:
        sender.close()
        receiver.close()


def test_a_put_runs_on_the_calling_thread_and_starts_no_other():
    receiver, sender = result_pipe(CTX)
    before = {t.ident for t in threading.enumerate()}
    try:
        for i in range(50):
            sender.put(protocol.Progress("r", i, 50))
        # A multiprocessing.Queue would have started its feeder thread by now.
        assert {t.ident for t in threading.enumerate()} == before
        assert [receiver.get(timeout=WAIT_S).step for _ in range(50)] == list(range(50))
    finally:
        sender.close()
        receiver.close()


def test_an_inline_sized_payload_fits_in_the_pipe_with_nobody_reading():
    allowed = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    if allowed < 1 << 20 or not hasattr(fcntl, "F_GETPIPE_SZ"):
        pytest.skip(f"this kernel caps pipes at {allowed} bytes")
    receiver, sender = result_pipe(CTX)
    try:
        size = fcntl.fcntl(receiver._conn.fileno(), fcntl.F_GETPIPE_SZ)
        assert size >= min(PIPE_BYTES, allowed)
        big = bytearray(900_000)  # under the 1,000,000-byte shared-memory threshold
        done = threading.Event()
        writer = threading.Thread(target=lambda: (sender.put(big), done.set()), daemon=True)
        writer.start()
        assert done.wait(WAIT_S), "a send of an inline payload blocked without a reader"
        assert receiver.get(timeout=WAIT_S) == big
    finally:
        sender.close()
        receiver.close()

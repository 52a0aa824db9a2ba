"""The worker -> executor result channel: a pipe the sending thread writes itself.

A multiprocessing.Queue hands each put to a feeder thread that pickles the message and writes
it in pipe-sized pieces. In a worker whose main thread launches GPU kernels from Python, every
wake of that feeder (once per progress step, and once per 64 KiB of an inline output) takes the
GIL from the launching thread and gives it back a context switch later. Here the thread that
sends pickles and writes, into a pipe enlarged to hold a whole inline payload, so a send costs
one system call and wakes no other thread of the worker. One writer at a time is the caller's
business (async_output.ResultWriter).

The executor keeps only the read end: when the worker dies, reads end (EOFError) instead of
waiting on a writer that will never finish its message.
"""

from __future__ import annotations

import fcntl
import pickle
import queue
from pathlib import Path
from typing import Any

PIPE_BYTES = 4 << 20  # above the largest inline payload of a small batch (1,000,000 B per tensor)
_MAX_PIPE_FILE = Path("/proc/sys/fs/pipe-max-size")


def _enlarge(fd: int) -> None:
    """Grow the pipe's kernel buffer as far as allowed (unprivileged: pipe-max-size, 1 MiB by
    default). Where that cannot be done the pipe keeps its default size: sends then block
    sooner, nothing else changes."""
    try:
        allowed = int(_MAX_PIPE_FILE.read_text())
    except (OSError, ValueError):
        allowed = PIPE_BYTES
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, min(PIPE_BYTES, allowed))
    except (AttributeError, OSError):
        pass


class ResultSender:
    """Worker side. Picklable (it travels to the spawned worker); not thread-safe on its own."""

    def __init__(self, conn) -> None:
        self._conn = conn

    def put(self, message: Any) -> None:
        self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        self._conn.close()


class ResultReceiver:
    """Executor side: one reader at a time (start-up, then the result pump)."""

    def __init__(self, conn) -> None:
        self._conn = conn

    def get(self, timeout: float | None = None) -> Any:
        """The next message; queue.Empty after `timeout` s; EOFError once every sender is gone
        (a message cut short by the worker's death included)."""
        if not self._conn.poll(timeout):
            raise queue.Empty
        return pickle.loads(self._conn.recv_bytes())

    def empty(self) -> bool:
        """Nothing to read right now."""
        return not self._conn.poll(0)

    def close(self) -> None:
        self._conn.close()


def result_pipe(ctx) -> tuple[ResultReceiver, ResultSender]:
    """A new channel from `ctx` (a multiprocessing context). After the worker has started, the
    executor closes its copy of the sender so the worker's death ends the reader's stream."""
    reader, writer = ctx.Pipe(duplex=False)
    _enlarge(writer.fileno())
    return ResultReceiver(reader), ResultSender(writer)

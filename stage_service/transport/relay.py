"""The segments a stage hands its caller through shared memory (core/shared_tensors.py), and what
becomes of those nobody reads.

The caller owns a segment once its message arrives: it passes the name to the next stage, which
unlinks it on reading, or reads it itself, or unlinks it when the request fails. Two windows
remain where no one would: the caller cancelled after the stage sent the message but before it
arrived, or the caller died. So the stage keeps the names it sent and unlinks any still there
after UNREAD_AFTER_S (a reader takes a segment as the next call begins, within milliseconds),
and all of them when it stops; a stage killed outright leaves them to the sweep of dead
processes' segments the next stage start on the host runs (transport/ipc.py, sweep_orphans).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable

from stagemesh.core import shared_tensors
from stagemesh.v1 import stage_pb2

UNREAD_AFTER_S = 120.0
MAX_REMEMBERED = 4096  # past this many unread names the oldest go first (a bound on the deque)


class SentSegments:
    """Names of segments sent and maybe not read yet, oldest first (used on the event loop only)."""

    def __init__(self, unread_after_s: float = UNREAD_AFTER_S) -> None:
        self._unread_after_s = unread_after_s
        self._sent: deque[tuple[float, str]] = deque()

    def sent(self, names: Iterable[str]) -> None:
        now = time.monotonic()
        self._sent.extend((now, name) for name in names)
        stale = []
        while self._sent and (now - self._sent[0][0] > self._unread_after_s or len(self._sent) > MAX_REMEMBERED):
            stale.append(self._sent.popleft()[1])
        shared_tensors.unlink(stale)

    def drop_all(self) -> None:
        names = [name for _, name in self._sent]
        self._sent.clear()
        shared_tensors.unlink(names)


def names_in(messages: Iterable[stage_pb2.StageOutputs]) -> list[str]:
    return [t.shm_name for m in messages for t in m.outputs.values() if t.shm_name]


def discard(messages: Iterable[stage_pb2.StageOutputs]) -> None:
    """Unlink the segments of messages that were never sent."""
    shared_tensors.discard(t for m in messages for t in m.outputs.values())


async def encoded(encode, *args) -> list[stage_pb2.StageOutputs]:
    """`encode(*args)` on a thread. Cancelled meanwhile, the segments the thread still makes are
    unlinked when it finishes: their messages will never be sent."""
    future = asyncio.ensure_future(asyncio.to_thread(encode, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda f: None if f.cancelled() or f.exception() else discard(f.result()))
        raise

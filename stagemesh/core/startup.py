"""Start-up phases: where the time from launch to ready goes.

Each phase is one JSON log line (event "startup phase") with its name, the process's role, its
wall-clock start (`at`, seconds since the epoch, so lines of different processes line up) and
its duration; each process keeps its phases (`records()`), a stage passes its rank 0 worker's on
with its own, and a service that finishes starting logs one "startup report" line holding them
all. The phases are listed in docs/OPERATIONS.md ("Start-up phases"); bench/cold_start.py reads
these lines from the mesh's log.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stagemesh.core import logs

log = logs.get_logger("stagemesh.startup")

PHASE_EVENT = "startup phase"
REPORT_EVENT = "startup report"
# The phase from the process's own start (exec) to the first phase it records: the interpreter
# and the imports before it.
PROCESS_PHASE = "process start and imports"

_lock = threading.Lock()
_records: list[dict[str, Any]] = []
_role = ""


def process_started_at() -> float | None:
    """When this process started (seconds since the epoch), from /proc; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces: the fields after it follow its ')'.
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def begin(role: str) -> None:
    """Name this process's role ("stage-1", "stage-1-worker-0", "gateway", ...) and record the
    phase from its start to now. Clock ticks are 10 ms: so is this phase's precision."""
    global _role
    with _lock:
        _role = role
        _records.clear()
    started = process_started_at()
    if started is not None:
        record(PROCESS_PHASE, started, max(0.0, time.time() - started))


def record(name: str, at: float, seconds: float, **fields: Any) -> dict[str, Any]:
    entry = {"phase": name, "role": _role, "at": round(at, 3), "seconds": round(seconds, 3), **fields}
    with _lock:
        _records.append(entry)
    log.info(PHASE_EVENT, **entry)
    return entry


@contextmanager
def phase(name: str, since: float | None = None, **fields: Any) -> Iterator[None]:
    """Time the block as one phase. A block that raises is recorded too, with failed=True.
    `since`: the phase began earlier, at that time.time() (work started before the block)."""
    at, started = time.time(), time.perf_counter()
    if since is not None:
        at, started = since, started - max(0.0, at - since)
    try:
        yield
    except BaseException:
        record(name, at, time.perf_counter() - started, failed=True, **fields)
        raise
    record(name, at, time.perf_counter() - started, **fields)


def records() -> list[dict[str, Any]]:
    with _lock:
        return [dict(r) for r in _records]


def add(entries: list[dict[str, Any]]) -> None:
    """Phases another process recorded (a worker's, carried in its Ready message): kept for this
    process's report, not logged again."""
    with _lock:
        _records.extend(dict(e) for e in entries)


def report(**fields: Any) -> dict[str, Any]:
    """Log the report line: every phase kept, and the time from the earliest one's start."""
    phases = records()
    first = min((p["at"] for p in phases), default=time.time())
    entry = {"role": _role, "ready_s": round(time.time() - first, 3), "phases": phases, **fields}
    log.info(REPORT_EVENT, **entry)
    return entry

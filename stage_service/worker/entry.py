"""What a spawned worker process runs first: light on purpose.

The spawn unpickles this module's `main` before anything runs, so everything this module imports
is paid before the worker's first phase. It imports no torch: the worker names its role, starts
reading its checkpoint into the page cache (worker/read_ahead.py) and only then imports torch,
the runners and, for a diffusers folder, diffusers (worker/process.py), so the read and the
imports overlap.
"""

from __future__ import annotations

import os
import signal
import sys

from stagemesh.core import logs, procutil, startup
from stagemesh.stage_service.models.model_dir import resolved_model_dir
from stagemesh.stage_service.transport import protocol
from stagemesh.stage_service.worker import read_ahead

IPC_MODULE = "stagemesh.stage_service.transport.ipc"


def _exit_orphaned(spec: protocol.WorkerSpec) -> None:
    try:
        ipc = sys.modules.get(IPC_MODULE)
        if ipc is not None:  # before the imports the worker has made no segment
            ipc.sweep(spec.parent_pid, spec.rank)
    finally:
        os._exit(0)  # whatever the sweep met: a worker never outlives its stage service


def main(spec: protocol.WorkerSpec, requests, results) -> None:
    # Not PR_SET_PDEATHSIG: Linux ties it to the *thread* that spawned us, and the executor may
    # spawn from a pool thread that ends before the service does.
    procutil.watch_parent(spec.parent_pid, lambda: _exit_orphaned(spec))
    # A spawned process starts with structlog unconfigured (it would print to stdout).
    settings = spec.settings
    logs.configure(f"stage-{settings.stage_id}-worker-{spec.rank}")
    startup.begin(f"stage-{settings.stage_id}-worker-{spec.rank}")
    # Ctrl-C reaches the whole process group; the service decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (e.g. to the whole process group): nobody will read our segments any more.
    signal.signal(signal.SIGTERM, lambda *_: _exit_orphaned(spec))
    # Rank 0's alone: every rank of a stage loads the same files, through one page cache.
    ahead = read_ahead.start_for(settings, resolved_model_dir(settings)) if spec.rank == 0 else None
    try:
        with startup.phase("worker imports"):
            from stagemesh.stage_service.worker import process
        process.run(spec, requests, results, ahead)
    finally:
        if ahead is not None:
            ahead.stop()  # joined on every path; already stopped after a load

"""Bringing worker processes up: spawn one with its request and result queues, then wait until
each rank reports Ready. A rank that cannot load is reported at once, even while the others
still load (or wait for it in their process group)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Iterator, Mapping
from typing import Any

from stagemesh.core import auth, errors, tls
from stagemesh.stage_service.transport import protocol
from stagemesh.stage_service.transport.result_pipe import result_pipe
from stagemesh.stage_service.worker import entry as worker_entry

POLL_S = 0.1
READY_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 10.0


def export_cache_security(token: str | None, tls_ca: str) -> None:
    """Workers publish to the cache service with the stage's token and CA; they inherit both
    through the environment, never through a command line: set before the first spawn."""
    if token:
        os.environ[auth.TOKEN_ENV] = token
    if tls_ca:
        tls.read_pem(tls_ca, "--tls-ca")  # an unreadable CA fails the start, not a later publication
        os.environ[tls.CA_ENV] = os.path.abspath(os.path.expanduser(tls_ca))


def spawn(ctx: Any, spec: protocol.WorkerSpec) -> tuple[mp.Process, Any, Any]:
    """Start the worker process of `spec`; returns it with its request queue and the read end
    of its result pipe."""
    requests = ctx.Queue()
    results, sender = result_pipe(ctx)
    process = ctx.Process(
        target=worker_entry.main,
        args=(spec, requests, sender),
        name=f"stagemesh-worker-{spec.settings.stage_id}-{spec.rank}",
        daemon=True,
    )
    process.start()
    sender.close()  # the worker has its own copy: its death now ends our reads (EOFError)
    return process, requests, results


def wait_ready(stage_name: str, workers: Mapping[int, Any], timeout_s: float) -> Iterator[tuple[int, protocol.Ready]]:
    """Yield (rank, Ready) as each worker (rank -> object with .process and .results) reports
    it. Raises Unavailable for the first rank that exits or fails to load, or at the deadline.
    Until a rank is yielded this is the only reader of its result queue."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(workers)
    while waiting:
        for rank, w in list(waiting.items()):
            ready = _poll(stage_name, rank, w, POLL_S / len(waiting))
            if ready is not None:
                del waiting[rank]
                yield rank, ready
        if waiting and time.monotonic() > deadline:
            raise errors.Unavailable(f"{stage_name} worker {next(iter(waiting))} not ready after {timeout_s:.0f} s")


def _poll(stage_name: str, rank: int, w: Any, timeout_s: float) -> protocol.Ready | None:
    try:
        msg = w.results.get(timeout=timeout_s)
    except EOFError:
        w.process.join(POLL_S)  # it closed its end: it is exiting
        raise errors.Unavailable(
            f"{stage_name} worker {rank} exited while loading (exit code {w.process.exitcode})"
        ) from None
    except queue.Empty:
        if not w.process.is_alive():
            raise errors.Unavailable(
                f"{stage_name} worker {rank} exited while loading (exit code {w.process.exitcode})"
            ) from None
        return None
    if isinstance(msg, protocol.LoadFailed):
        raise errors.Unavailable(f"{stage_name} worker {rank} failed to load: {msg.message}")
    return msg if isinstance(msg, protocol.Ready) else None

"""One worker process per rank: loads the model runner and executes batches from its queue."""

from __future__ import annotations

import collections
import queue
import signal
import traceback
from pathlib import Path

from stage_service import ipc, protocol


class _CancelledByCaller(Exception):
    pass


class _Inbox:
    """The request queue, read so that a Cancel can be noticed between denoising steps."""

    def __init__(self, requests):
        self._requests = requests
        self._backlog: collections.deque = collections.deque()

    def next(self):
        return self._backlog.popleft() if self._backlog else self._requests.get()

    def cancelled(self, rpc_id: str) -> bool:
        """Drain what arrived without blocking; True if `rpc_id` was cancelled."""
        hit = False
        while True:
            try:
                msg = self._requests.get_nowait()
            except queue.Empty:
                return hit
            if isinstance(msg, protocol.Cancel):
                if msg.rpc_id == rpc_id:
                    hit = True
                else:
                    # A queued batch cancelled before it started is simply dropped.
                    self._backlog = collections.deque(
                        m for m in self._backlog if getattr(m, "rpc_id", None) != msg.rpc_id
                    )
            else:
                self._backlog.append(msg)


def device_memory_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.memory_allocated(torch.device(device)))
    return 0


def resolve_device(device: str, rank: int) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return f"cuda:{rank % torch.cuda.device_count()}"
    return device


def _execute(runner, msg: protocol.Execute, inbox: _Inbox, results) -> None:
    from stage_service.models.runners import WorkItem

    def progress(step: int, total: int) -> None:
        if inbox.cancelled(msg.rpc_id):
            raise _CancelledByCaller()
        results.put(protocol.Progress(msg.rpc_id, step, total))

    try:
        items = [WorkItem(**{**item, "inputs": ipc.unpack(item["inputs"])}) for item in msg.items]
        outputs = runner.run(items, progress)
        results.put(protocol.Result(msg.rpc_id, [ipc.pack(o) for o in outputs]))
    except _CancelledByCaller:
        results.put(protocol.Failure(msg.rpc_id, "cancelled by the caller", cancelled=True))
    except Exception as exc:  # noqa: BLE001 - reported to the executor, the worker lives on
        traceback.print_exc()
        results.put(protocol.Failure(msg.rpc_id, f"{type(exc).__name__}: {exc}"))


def main(spec: protocol.WorkerSpec, requests, results) -> None:
    from stagemesh import procutil

    procutil.die_with_parent(spec.parent_pid)
    # Ctrl-C reaches the whole process group; the service decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    if spec.threads > 0:
        torch.set_num_threads(spec.threads)
    from stage_service.models.runners import build_runner

    device = resolve_device(spec.device, spec.rank)
    try:
        runner = build_runner(spec.kind, Path(spec.model_dir), device)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        results.put(protocol.LoadFailed(spec.rank, f"{type(exc).__name__}: {exc}"))
        return
    results.put(protocol.Ready(spec.rank, runner.limits(), device, device_memory_bytes(device)))

    inbox = _Inbox(requests)
    while True:
        msg = inbox.next()
        if isinstance(msg, protocol.Shutdown):
            return
        if isinstance(msg, protocol.Execute):
            _execute(runner, msg, inbox, results)
        # A Cancel for a batch that already finished needs no answer.

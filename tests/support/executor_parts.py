"""Shared pieces of the executor tests: output ids, pending RPCs on a worker record, packed
outputs as a worker sends them."""

from __future__ import annotations

import concurrent.futures as cf
import os

import torch

from stagemesh.stage_service.executor.multiproc import PendingCall, WorkerProcess
from stagemesh.stage_service.transport import ipc

WAIT_S = 10.0


def oid(n: int) -> str:
    return f"{n:032x}"


def pend(w: WorkerProcess, rpc_id: str, on_progress=None) -> cf.Future:
    fut: cf.Future = cf.Future()
    w.pending[rpc_id] = PendingCall(fut, on_progress)
    return fut


def packed_outputs(*seeds: int, big: bool = True, rank: int = 0):
    """What a worker sends: one packed dict per batch item (big ones via shared memory)."""
    n = 300_000 if big else 3
    return ipc.Packer(os.getpid(), rank).pack([{"image": torch.full((n,), float(s))} for s in seeds])

"""Messages on the executor <-> worker queues (plain picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    stage_id: int
    kind: str
    model_dir: str
    device: str
    parent_pid: int
    threads: int = 0


# executor -> worker
@dataclass(frozen=True)
class Execute:
    rpc_id: str
    items: list[dict[str, Any]]  # WorkItem fields; tensors packed by ipc.pack


@dataclass(frozen=True)
class Cancel:
    rpc_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


# worker -> executor
@dataclass(frozen=True)
class Ready:
    rank: int
    limits: dict[str, Any]
    device: str
    device_memory_bytes: int


@dataclass(frozen=True)
class LoadFailed:
    rank: int
    message: str


@dataclass(frozen=True)
class Progress:
    rpc_id: str
    step: int
    total: int


@dataclass(frozen=True)
class Result:
    rpc_id: str
    outputs: list[Any] = field(default_factory=list)  # one packed dict per item


@dataclass(frozen=True)
class Failure:
    rpc_id: str
    message: str
    cancelled: bool = False

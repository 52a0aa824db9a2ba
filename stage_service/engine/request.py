"""A request inside the stage engine, the batch it runs in, and the events its caller reads."""

from __future__ import annotations

import asyncio
import collections
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.contract import WorkItem

if TYPE_CHECKING:
    from stagemesh.stage_service.engine.spans import RequestSpans


@dataclass(frozen=True)
class ProgressEvent:
    step: int
    total: int


@dataclass(frozen=True)
class OutputsEvent:
    outputs: dict[str, torch.Tensor]


@dataclass(eq=False)
class StageRequest:
    request_id: str
    params: Params
    inputs: dict[str, torch.Tensor]
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    batch: Batch | None = None
    done: bool = False
    output_id: str = ""
    # False when the caller left num_inference_steps to the stage's default (DP waves refuse it).
    explicit_steps: bool = True
    # Unique inside the engine (client request ids may repeat): names this request's share of a batch output.
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Requests of this id sent at once (the images of one Generate; image_groups.py), and when
    # this one was admitted (the event loop's clock).
    images: int = 1
    arrived: float = 0.0
    trace: RequestSpans | None = None  # its spans, while tracing is on

    def work_item(self) -> WorkItem:
        return WorkItem(self.request_id, self.params, self.inputs)


@dataclass(eq=False)
class Batch:
    group: int  # the executor's worker group it runs on
    requests: list[StageRequest]
    rpc_id: str = ""


class Dispatcher(Protocol):
    """How the engine hands admitted requests to a free worker group: batches of compatible
    requests, or DP waves (waves_scheduler.py)."""

    depth: int  # dispatches a group may hold at once

    def admit(self, req: StageRequest) -> None: ...  # raise for a request no dispatch can run

    # In place; [] holds every request back for now (the dispatcher wakes the engine later).
    def take(self, waiting: collections.deque[StageRequest]) -> list[StageRequest]: ...

    async def run(self, group: int, requests: list[StageRequest]) -> None: ...  # releases the group

"""Worker groups: the unit of dispatch, death and restart of a stage.

A group is one worker process, the N tensor-parallel ranks of one model, the N ranks that split
each image (sequence or CFG parallel), or the N ranks of a DLO AllGather group that take
requests in DP waves. Every call reaches every process of the
group and resolves with the answers of its output ranks (a TP group has one, rank 0; a wave
group has all of them), or with the first error. When one process of a group dies the group
is down as a whole, and it is restarted as a whole, with a fresh rendezvous address: a group
with a dead or hung member cannot be repaired one rank at a time (its collectives would never
complete).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing as mp
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stagemesh.core.procutil import free_port
from stagemesh.stage_service.executor.outputs import resolve_future
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.transport import protocol

ProgressFn = Callable[[int, int], None]


@dataclass
class PendingCall:
    future: cf.Future
    on_progress: ProgressFn | None


@dataclass
class WorkerProcess:
    spec: protocol.WorkerSpec
    process: mp.Process
    requests: Any
    results: Any
    pending: dict[str, PendingCall] = field(default_factory=dict)
    pump: threading.Thread | None = None
    ready: protocol.Ready | None = None
    stats: protocol.WorkerStats | None = None  # from the worker's latest reply
    stopping: bool = False
    shutdown_sent: bool = False  # a Shutdown is in its request queue
    group: int = 0  # index of its WorkerGroup
    last_heard: float = 0.0  # monotonic time of its latest message (heartbeats included)
    hung_for: float = 0.0  # seconds of silence after which it was killed as hung; 0: not hung


@dataclass
class WorkerGroup:
    index: int
    specs: list[protocol.WorkerSpec]  # one per process, in rank order
    collective: str = ""  # "tp", "image" or "dp": the processes form one torch.distributed group
    waves: bool = False  # a dispatch is a DP wave: one batch per rank, every rank answers
    workers: list[WorkerProcess] = field(default_factory=list)  # the running processes, in rank order

    @property
    def size(self) -> int:
        return len(self.specs)

    @property
    def ranks(self) -> list[int]:
        return [s.rank for s in self.specs]

    @property
    def output_ranks(self) -> list[int]:
        return [s.rank for s in self.specs if s.output_rank]

    def down_rank(self) -> int | None:
        """A rank that cannot take calls (not started, stopping or exited); None: all up."""
        if len(self.workers) != self.size:
            return self.specs[0].rank
        for w in self.workers:
            if w.stopping or not w.process.is_alive():
                return w.spec.rank
        return None

    def fresh_specs(self, timeout_s: float) -> list[protocol.WorkerSpec]:
        """The specs of a (re)start: a new rendezvous every time, the old group's port may still be held."""
        if not self.collective:
            return self.specs
        address = protocol.DpGroup(f"tcp://127.0.0.1:{free_port()}", self.size, timeout_s)
        if self.collective == "dp":
            return [dataclasses.replace(spec, dp_group=address) for spec in self.specs]
        if self.collective == "image":
            return [dataclasses.replace(spec, image_group=address) for spec in self.specs]
        return [dataclasses.replace(spec, tp_group=address) for spec in self.specs]


def build_groups(settings: StageSettings, parent_pid: int) -> list[WorkerGroup]:
    """The stage's groups: TP ranks or the ranks that split each image as one group, a DLO
    AllGather group as one wave group, else one group per worker process. Option combinations
    were checked where the settings were built."""
    base = protocol.WorkerSpec(settings, rank=0, parent_pid=parent_pid)
    ranks = range(settings.worker_processes())
    lockstep = "tp" if settings.tensor_parallel_size > 1 else "image" if settings.image_parallel_size() > 1 else ""
    if lockstep:
        # Rank 0 alone reports progress and outputs; the others run each batch with it.
        specs = [dataclasses.replace(base, rank=r, output_rank=r == 0) for r in ranks]
        return [WorkerGroup(0, specs, collective=lockstep)]
    if settings.dp_group_size() > 1:
        return [WorkerGroup(0, [dataclasses.replace(base, rank=r) for r in ranks], collective="dp", waves=True)]
    return [WorkerGroup(r, [dataclasses.replace(base, rank=r)]) for r in ranks]


class GroupCall:
    """One message to each process of a group. `parts`: one future per answering process, in
    rank order; `future`: the output ranks' answers (rank -> answer) once every part resolved,
    or the first error at once."""

    def __init__(self, parts: Sequence[cf.Future], ranks: Sequence[int], output_ranks: Sequence[int]) -> None:
        self.parts = list(parts)
        self.future: cf.Future = cf.Future()
        self._by_rank = dict(zip(ranks, parts))
        self._outputs = list(output_ranks)
        for part in self.parts:
            part.add_done_callback(self._settle)
        # A caller that gives up cancels every part: their outputs are dropped when they arrive.
        self.future.add_done_callback(_cancel_parts_of(weakref.ref(self)))

    def by_output_rank(self) -> dict[int, cf.Future]:
        """Output rank -> its own answer, failed if its part or a part of a non-output rank failed
        (such a rank ran the call for it): the ranks of a wave answer one by one, a TP group as one."""
        helpers = [p for r, p in self._by_rank.items() if r not in self._outputs]
        return {r: _joined(self._by_rank[r], helpers) for r in self._outputs}

    def _settle(self, part: cf.Future) -> None:
        if part.cancelled():
            self.future.cancel()
            return
        if part.exception() is not None:
            resolve_future(self.future, exc=part.exception())
            return
        if all(p.done() for p in self.parts) and not self.future.done():
            resolve_future(self.future, result={r: self._by_rank[r].result() for r in self._outputs})
        if self.future.done():
            # Answered: the parts (whose callbacks point back here) need not outlive the answer.
            self.parts, self._by_rank = [], {}


# The links back from an answer to what produced it (cancellation) are weak: with strong ones each
# call would be a reference cycle, and a batch's outputs, with the shared-memory slots under them,
# would live until the garbage collector ran instead of until their last reader dropped them.
def _cancel_parts_of(call: weakref.ref[GroupCall]) -> Callable[[cf.Future], None]:
    def cancel(future: cf.Future) -> None:
        alive = call()
        if future.cancelled() and alive is not None:
            for part in alive.parts:
                part.cancel()

    return cancel


def _cancel_if_cancelled(source: weakref.ref[cf.Future]) -> Callable[[cf.Future], None]:
    def cancel(future: cf.Future) -> None:
        alive = source()
        if future.cancelled() and alive is not None:
            alive.cancel()

    return cancel


def _joined(own: cf.Future, helpers: list[cf.Future]) -> cf.Future:
    out: cf.Future = cf.Future()
    parts = [own, *helpers]

    def settle(_: cf.Future) -> None:
        failed = next((p for p in parts if p.done() and (p.cancelled() or p.exception() is not None)), None)
        if failed is not None:
            resolve_future(out, exc=failed.exception() if not failed.cancelled() else cf.CancelledError())
        elif parts and all(p.done() for p in parts):
            resolve_future(out, result=parts[0].result())  # parts[0] is `own`
        if out.done():
            parts.clear()  # nothing more to wait for: the parts need not outlive the answer

    for p in parts:
        p.add_done_callback(settle)
    return out


def first_answer(call: GroupCall) -> cf.Future:
    """The answer of a group's (only or first) output rank."""
    out: cf.Future = cf.Future()

    def forward(done: cf.Future) -> None:
        if done.cancelled():
            out.cancel()
        elif done.exception() is not None:
            resolve_future(out, exc=done.exception())
        else:
            resolve_future(out, result=next(iter(done.result().values())))

    call.future.add_done_callback(forward)
    out.add_done_callback(_cancel_if_cancelled(weakref.ref(call.future)))
    return out

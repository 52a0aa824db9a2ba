"""DP waves in the stage engine (docs/DLO.md, "DP waves"): with DLO AllGather and dp_size > 1 the stage's
ranks form one process group, and the engine runs requests as waves of up to dp_size, one per
rank, instead of batches on free workers.

- Admission refuses a request that can never run in a wave (empty prompt, num_inference_steps
  not explicit) with INVALID_ARGUMENT naming the field, before anything is dispatched.
- A wave is the head of the queue plus the next requests with the same steps, size and guidance
  (the rules of `offload.waves.check_wave`), in arrival order; a request that differs keeps its
  place and heads a later wave.
- Every rank must issue the same weight collectives in the same order, so a rank without a
  request of its own runs a filler: a copy of the wave's first request whose output is
  discarded.
- One wave at a time: the wave timeout measures one wave, and a failed wave restarts the whole
  group, which would also take down a wave queued behind it.
- A wave is one call to the worker group (executor/group.py): one batch per rank. A wave whose
  ranks do not all answer (COMPUTE_DONE) within STAGEMESH_DLO_DP_WAVE_TIMEOUT fails closed: every
  request in it gets UNAVAILABLE naming the stage, and the engine restarts the group as a whole
  (a group with a dead or hung member cannot be repaired one rank at a time).
- A request cancelled inside a wave is not cancelled on its rank: a rank leaving the wave early
  would leave the others waiting in a collective. Its output is dropped when the wave ends.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
from typing import TYPE_CHECKING, Any, Protocol

from stagemesh.core import errors, logs
from stagemesh.stage_service.engine.request import StageRequest
from stagemesh.stage_service.engine.wave_rules import (
    WaveFailed,
    WaveRejected,
    WaveRequest,
    check_wave,
    run_wave,
    wave_timeout,
)
from stagemesh.stage_service.executor.multiproc import ProgressFn
from stagemesh.stage_service.transport import protocol

if TYPE_CHECKING:
    from stagemesh.stage_service.executor.multiproc import Executor

log = logs.get_logger("stagemesh.waves")


class WaveHost(Protocol):
    """What the wave scheduler needs of the engine that owns it."""

    def deliver(self, req: StageRequest, event: Any) -> None: ...
    async def collect(self, requests: list[StageRequest], done: Any) -> None: ...
    def progress_listener(self, requests: list[StageRequest]) -> ProgressFn: ...
    def release(self, group: int) -> None: ...
    def restart_group(self, group: int, reason: str) -> None: ...


def wave_request(req: StageRequest) -> WaveRequest:
    return WaveRequest(req.request_id, req.params, req.explicit_steps)


def _fits(wave: list[StageRequest], req: StageRequest, size: int) -> bool:
    if len(wave) >= size:
        return False
    try:
        check_wave([wave_request(r) for r in [*wave, req]], size)
    except WaveRejected:
        return False
    return True


class WaveScheduler:
    """The engine's dispatcher for a DP-wave group: one wave in flight at a time."""

    depth = 1

    def __init__(self, engine: WaveHost, executor: Executor) -> None:
        self._engine = engine
        self._executor = executor
        self.size = next(g.size for g in executor.groups if g.waves)
        self.counts: collections.Counter = collections.Counter()  # waves, requests, fillers, failed

    def admit(self, req: StageRequest) -> None:
        """Refuse a request that no wave can run: INVALID_ARGUMENT naming the field."""
        try:
            check_wave([wave_request(req)], self.size)
        except WaveRejected as exc:
            raise errors.InvalidArgument.field(f"params.{exc.field}", str(exc)) from None

    def take(self, waiting: collections.deque[StageRequest]) -> list[StageRequest]:
        """Take the next wave off the queue (in place)."""
        wave = [waiting.popleft()]  # the head always goes: admission checked it alone
        rest: list[StageRequest] = []
        while waiting:
            r = waiting.popleft()
            (wave if _fits(wave, r, self.size) else rest).append(r)
        waiting.extend(rest)
        return wave

    async def run(self, group: int, wave: list[StageRequest]) -> None:
        try:
            results = await self._run_ranks(group, wave)
        finally:
            self._engine.release(group)
        if results is not None:
            await asyncio.gather(*(self._engine.collect([r], done) for r, done in zip(wave, results)))

    async def _run_ranks(self, group: int, wave: list[StageRequest]) -> list[Any] | None:
        """Dispatch the wave as one group call and wait for every rank; None when it did not run."""
        requests = [wave_request(r) for r in wave]
        futures: list[cf.Future] = []
        self.counts.update(waves=1, requests=len(wave), fillers=self.size - len(wave))
        try:
            check_wave(requests, self.size)  # before anything is dispatched
            # A rank without a request of its own runs a filler: a copy of the wave's first request.
            owners = [*wave, *[None] * (self.size - len(wave))]
            batches = [[(owner or wave[0]).work_item()] for owner in owners]
            listeners = [self._engine.progress_listener([o]) if o is not None else None for o in owners]
            futures = self._executor.submit_wave(group, batches, listeners)
            for fut in futures[len(wave) :]:
                fut.add_done_callback(self._drop_output)
            return await asyncio.to_thread(
                run_wave, requests, self.size, lambda rank, *_: futures[rank], wave_timeout()
            )
        except WaveRejected as exc:  # admission and take() keep such waves from forming
            self._fail(wave, errors.InvalidArgument.field(f"params.{exc.field}", str(exc)))
        except Exception as exc:  # noqa: BLE001 - WaveFailed, or a dispatch that broke midway
            why = str(exc) if isinstance(exc, WaveFailed) else f"DP wave failed: {type(exc).__name__}: {exc}"
            self.counts.update(failed=1)
            for fut in futures:
                self._drop_output(fut)  # what the ranks that did answer computed
            self._fail(wave, errors.Unavailable(f"{self._executor.stage_name}: {why}; the stage restarts its DP group"))
            self._engine.restart_group(group, why)
        return None

    def _fail(self, wave: list[StageRequest], exc: BaseException) -> None:
        for r in wave:
            self._engine.deliver(r, exc)

    def _drop_output(self, fut: cf.Future) -> None:
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            done = fut.result()
            if isinstance(done, protocol.ComputeDone):
                self._executor.outputs.discard(done.async_output_id)

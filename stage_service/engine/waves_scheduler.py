"""DP waves in the stage engine (DESIGN §4.2.7): with DLO AllGather and dp_size > 1 the stage's
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
- A wave whose ranks do not all answer (COMPUTE_DONE) within STAGEMESH_DLO_DP_WAVE_TIMEOUT fails
  closed: every request in it gets UNAVAILABLE naming the stage, and all ranks are restarted as
  a new group (a group with a dead or hung member cannot be repaired one rank at a time).
- A request cancelled inside a wave is not cancelled on its rank: a rank leaving the wave early
  would leave the others waiting in a collective. Its output is dropped when the wave ends.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from stage_service.engine.request import StageRequest
from stage_service.engine.wave_rules import WaveFailed, WaveRejected, WaveRequest, check_wave, run_wave, wave_timeout
from stage_service.executor.executor import ProgressFn
from stage_service.transport import protocol
from stagemesh.core import errors, logs

if TYPE_CHECKING:
    from stage_service.executor.executor import Executor

log = logs.get_logger("stagemesh.waves")


class WaveHost(Protocol):
    """What the wave scheduler needs of the engine that owns it."""

    def wake(self) -> None: ...
    def deliver(self, req: StageRequest, event: Any) -> None: ...
    async def collect(self, requests: list[StageRequest], done: Any) -> None: ...
    def progress_listener(self, requests: list[StageRequest]) -> ProgressFn: ...
    def spawn(self, work: Awaitable[None]) -> None: ...
    def ranks_down(self, ranks: Iterable[int]) -> None: ...
    async def ranks_up(self, ranks: Iterable[int]) -> None: ...
    def fail_waiting(self, exc: BaseException) -> None: ...


RECOVERY_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)


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
    def __init__(self, engine: WaveHost, executor: Executor) -> None:
        self._engine = engine
        self._executor = executor
        self.size = executor.wave_size
        self.running = False
        self.recovering = False
        self.counts = collections.Counter()  # waves, requests, fillers, failed (for ops and tests)

    def admit(self, req: StageRequest) -> None:
        """Refuse a request that no wave can run: INVALID_ARGUMENT naming the field."""
        try:
            check_wave([wave_request(req)], self.size)
        except WaveRejected as exc:
            raise errors.InvalidArgument.field(f"params.{exc.field}", str(exc)) from None

    def ready(self) -> bool:
        return not self.running and not self.recovering

    def next_wave(self, waiting: collections.deque) -> list[StageRequest]:
        """Take the next wave off the queue (in place); the wave counts as running from here."""
        wave = [waiting.popleft()]  # the head always goes: admission checked it alone
        rest: collections.deque = collections.deque()
        while waiting:
            r = waiting.popleft()
            (wave if _fits(wave, r, self.size) else rest).append(r)
        waiting.extend(rest)
        self.running = True
        return wave

    async def run(self, wave: list[StageRequest]) -> None:
        try:
            results = await self._run_ranks(wave)
        finally:
            self.running = False
            self._engine.wake()
        if results is not None:
            await asyncio.gather(*(self._engine.collect([r], done) for r, done in zip(wave, results)))

    async def _run_ranks(self, wave: list[StageRequest]) -> list[Any] | None:
        """Dispatch the wave and wait for every rank; None when the wave did not run."""
        futures: list[cf.Future] = []

        def dispatch(rank: int, request: WaveRequest | None, _shape: WaveRequest) -> cf.Future:
            owner = wave[rank] if request is not None else None
            item = (owner or wave[0]).work_item()  # filler: a copy of the wave's first request
            progress = self._engine.progress_listener([owner]) if owner is not None else None
            _, fut = self._executor.submit(rank, [item], progress)
            if owner is None:
                fut.add_done_callback(self._drop_output)
            futures.append(fut)
            return fut

        requests = [wave_request(r) for r in wave]
        self.counts.update(waves=1, requests=len(wave), fillers=self.size - len(wave))
        try:
            return await asyncio.to_thread(run_wave, requests, self.size, dispatch, wave_timeout())
        except WaveRejected as exc:  # admission and next_wave() keep such waves from forming
            self._fail(wave, errors.InvalidArgument.field(f"params.{exc.field}", str(exc)))
        except Exception as exc:  # noqa: BLE001 - WaveFailed, or a dispatch that broke midway
            why = str(exc) if isinstance(exc, WaveFailed) else f"DP wave failed: {type(exc).__name__}: {exc}"
            self.counts.update(failed=1)
            for fut in futures:
                self._drop_output(fut)  # what the ranks that did answer computed
            self._fail(wave, errors.Unavailable(f"{self._executor.stage_name}: {why}; the stage restarts its DP group"))
            self.recover(why)
        return None

    def _fail(self, wave: list[StageRequest], exc: BaseException) -> None:
        for r in wave:
            self._engine.deliver(r, exc)

    def _drop_output(self, fut: cf.Future) -> None:
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            done = fut.result()
            if isinstance(done, protocol.ComputeDone):
                self._executor.outputs.discard(done.async_output_id)

    # recovery ---------------------------------------------------------------------------------
    def rank_died(self, rank: int, reason: str) -> None:
        # A death reported after the group was already replaced concerns an old process.
        if not self._executor.is_alive(rank):
            self.recover(reason)

    def recover(self, reason: str) -> None:
        if self.recovering:
            return
        self.recovering = True
        log.error("dp group down; restarting every rank", reason=reason, ranks=self.size)
        self._engine.ranks_down(range(self.size))
        self._engine.spawn(self._recover())

    async def _recover(self) -> None:
        for attempt, delay in enumerate(RECOVERY_BACKOFF_S, start=1):
            try:
                await asyncio.to_thread(self._executor.restart_group)
            except Exception as exc:  # noqa: BLE001 - retried with backoff, never left half-done
                log.error("dp group restart failed", attempt=attempt, error=str(exc))
                await asyncio.sleep(delay)
                continue
            self.recovering = False
            log.info("dp group restarted", attempt=attempt, ranks=self.size)
            await self._engine.ranks_up(range(self.size))
            return
        log.error("dp group stays down after repeated restart failures")
        self._engine.fail_waiting(
            errors.Unavailable(f"{self._executor.stage_name}: its DP group could not be restarted")
        )

"""Admission, batching of compatible requests, dispatch to free workers, restart of dead ones.
A stage whose ranks form a DLO AllGather group runs DP waves instead (waves_scheduler.py).

Runs on the service's event loop; all blocking work happens in the executor's processes or
in threads.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import torch

from stage_service.engine.request import Batch, OutputsEvent, ProgressEvent, StageRequest
from stage_service.engine.waves_scheduler import WaveScheduler
from stage_service.executor.executor import Executor, ProgressFn
from stage_service.executor.outputs import output_timeout
from stagemesh.core import errors, logs
from stagemesh.core.backoff import Backoff
from stagemesh.core.params import Params

log = logs.get_logger("stagemesh.engine")

RESTART_BACKOFF = Backoff((0.5, 1.0, 2.0, 5.0, 10.0))
DISPATCH_DEPTH = 2


class Engine:
    def __init__(
        self,
        executor: Executor,
        kind: str,
        workers: int,
        max_batch_size: int,
        max_queue: int,
        on_health: Callable[[bool], Any] | None = None,
    ):
        self._executor = executor
        self._kind = kind
        self._max_batch = max(1, max_batch_size)
        self._max_queue = max_queue
        self._waiting: collections.deque[StageRequest] = collections.deque()
        # Batches handed to each worker and not yet COMPUTE_DONE. Up to DISPATCH_DEPTH per worker,
        # so the next batch already waits in the worker's queue when a forward pass ends.
        self._in_flight: dict[int, int] = {rank: 0 for rank in range(workers)}
        self._dead_ranks: set[int] = set()
        self._workers = workers
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_health = on_health
        self._tasks: set[asyncio.Task] = set()
        self._closed_reason: str | None = None  # set while the stage sleeps: new requests refused
        self._active_batches = 0
        self._admitted = 0  # requests inside run(): waiting, running or delivering
        self._idle = asyncio.Event()
        self._idle.set()
        self.on_worker_restarted: Callable[[int], Awaitable[None]] | None = None
        # DLO AllGather with dp_size > 1: requests run in DP waves across all ranks.
        self._waves = WaveScheduler(self, executor) if executor.wave_size > 1 else None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._scheduler = asyncio.create_task(self._schedule(), name="engine-scheduler")

    async def close(self) -> None:
        for task in [self._scheduler, *self._tasks]:
            if task is not None:
                task.cancel()
        for r in self._waiting:
            r.events.put_nowait(errors.Unavailable("stage is shutting down"))
        self._waiting.clear()

    @property
    def serving(self) -> bool:
        return len(self._dead_ranks) < self._workers

    @property
    def queue_depth(self) -> int:
        """Requests admitted and not finished."""
        return self._admitted

    @property
    def waiting(self) -> int:
        """Admitted requests not yet handed to a worker."""
        return len(self._waiting)

    # public -----------------------------------------------------------------------------------
    async def run(
        self, request_id: str, params: Params, inputs: dict[str, torch.Tensor], explicit_steps: bool = True
    ) -> AsyncIterator[Any]:
        """Admit one request; yield ProgressEvents then one OutputsEvent. Cancelling the
        consumer frees the request's place in the queue or in its batch."""
        if len(self._waiting) >= self._max_queue:
            raise errors.ResourceExhausted(f"stage queue is full ({self._max_queue} waiting); retry later")
        if self._closed_reason is not None:
            raise errors.FailedPrecondition(self._closed_reason)
        if not self.serving:
            raise errors.Unavailable("no worker of this stage is running")
        req = StageRequest(request_id, params, inputs, explicit_steps=explicit_steps)
        if self._waves is not None:
            self._waves.admit(req)
        self._waiting.append(req)
        self._admitted += 1
        self._wake.set()
        try:
            while True:
                event = await req.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, OutputsEvent):
                    return
        finally:
            self._admitted -= 1
            req.done = True
            self._abandon(req)

    # admission for sleep ----------------------------------------------------------------------
    async def close_admission(self, reason: str) -> None:
        """Refuse new requests with FAILED_PRECONDITION(reason), fail the queued ones, and wait
        until every dispatched batch has delivered its outputs."""
        self._closed_reason = reason
        while self._waiting:
            self.deliver(self._waiting.popleft(), errors.FailedPrecondition(reason))
        await self._idle.wait()

    def open_admission(self) -> None:
        self._closed_reason = None
        self._wake.set()

    def live_ranks(self) -> list[int]:
        return [r for r in self._in_flight if r not in self._dead_ranks]

    def restarting_ranks(self) -> list[int]:
        return [r for r in self._in_flight if r in self._dead_ranks]

    # scheduling -------------------------------------------------------------------------------
    def _compatible(self, a: Params, b: Params) -> bool:
        # A denoising stage samples a batch as one: same size, steps and guidance.
        return self._kind not in ("diffusion", "denoise") or a.batch_key() == b.batch_key()

    def _take_batch(self) -> list[StageRequest]:
        head = self._waiting.popleft()
        batch, rest = [head], collections.deque()
        while self._waiting:
            r = self._waiting.popleft()
            if len(batch) < self._max_batch and self._compatible(head.params, r.params):
                batch.append(r)
            else:
                rest.append(r)
        self._waiting = rest
        return batch

    async def _schedule(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._waves is not None:
                while self._waiting and self._waves.ready():
                    self._launch(self._waves.run(self._waves.next_wave(self._waiting)))
                continue
            while self._waiting and (rank := self._free_rank()) is not None:
                self._in_flight[rank] += 1
                self._dispatch(rank, self._take_batch())

    def _free_rank(self) -> int | None:
        ready = [r for r, n in self._in_flight.items() if n < DISPATCH_DEPTH and r not in self._dead_ranks]
        return min(ready, key=self._in_flight.__getitem__) if ready else None

    def _dispatch(self, rank: int, requests: list[StageRequest]) -> None:
        batch = Batch(rank, requests)
        for r in requests:
            r.batch = batch
        self._launch(self._execute_batch(batch))

    def _launch(self, work: Awaitable[None]) -> None:
        # Busy from here, not from when the task first runs: a close_admission() in between must
        # wait for this work, or its control message would overtake it to the worker.
        self._active_batches += 1
        self._idle.clear()
        self.spawn(self._run_active(work))

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_active(self, work: Awaitable[None]) -> None:
        try:
            await work
        finally:
            self._active_batches -= 1
            if not self._active_batches:
                self._idle.set()

    def progress_listener(self, requests: list[StageRequest]) -> ProgressFn:
        loop = self._loop

        def on_progress(step: int, total: int) -> None:  # pump thread
            loop.call_soon_threadsafe(self._fan_out, requests, ProgressEvent(step, total))

        return on_progress

    async def _execute_batch(self, batch: Batch) -> None:
        on_progress = self.progress_listener(batch.requests)
        batch.rpc_id, fut = self._executor.submit(batch.rank, [r.work_item() for r in batch.requests], on_progress)
        try:
            done = await asyncio.wrap_future(fut)
        except Exception as exc:  # noqa: BLE001 - every request of the batch gets the error
            self._fan_out(batch.requests, exc)
            return
        finally:
            # COMPUTE_DONE (or the synchronous result) frees the worker for the next batch at once.
            self._release(batch.rank)
        await self.collect(batch.requests, done)

    async def collect(self, requests: list[StageRequest], done: Any) -> None:
        """Hand each request its outputs: a step-mode result carries them, a COMPUTE_DONE names
        the batch output to split."""
        if isinstance(done, list):
            for r, outputs in zip(requests, done):
                self.deliver(r, OutputsEvent(outputs))
            return
        sub_ids = self._executor.outputs.split(done.async_output_id, [r.key for r in requests])
        await asyncio.gather(*(self._await_output(r, sub_id) for r, sub_id in zip(requests, sub_ids)))

    async def _await_output(self, req: StageRequest, output_id: str) -> None:
        registry = self._executor.outputs
        if req.done:
            registry.discard(output_id)
            return
        req.output_id = output_id
        timeout_s = output_timeout()
        try:
            outputs = await asyncio.wait_for(asyncio.wrap_future(registry.future(output_id)), timeout_s)
        except TimeoutError:
            registry.discard(output_id)
            self.deliver(req, registry.timeout_error(output_id, timeout_s))
        except asyncio.CancelledError:
            registry.discard(output_id)  # the request went away while its output was on its way
        except Exception as exc:  # noqa: BLE001
            self.deliver(req, exc)
        else:
            self.deliver(req, OutputsEvent(outputs))

    def _release(self, rank: int) -> None:
        self._in_flight[rank] = max(0, self._in_flight[rank] - 1)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _fan_out(self, requests: list[StageRequest], event: Any) -> None:
        for r in requests:
            self.deliver(r, event)

    @staticmethod
    def deliver(req: StageRequest, event: Any) -> None:
        if not req.done:
            req.events.put_nowait(event)

    def fail_waiting(self, exc: BaseException) -> None:
        while self._waiting:
            self.deliver(self._waiting.popleft(), exc)

    def _abandon(self, req: StageRequest) -> None:
        if req in self._waiting:
            self._waiting.remove(req)
            return
        batch = req.batch
        if batch is not None and all(r.done for r in batch.requests):
            # Nobody waits for this batch any more: stop the worker between steps.
            self._executor.cancel(batch.rank, batch.rpc_id)

    # worker death -----------------------------------------------------------------------------
    def worker_died(self, rank: int, reason: str) -> None:
        """Called from the executor's pump thread."""
        self._loop.call_soon_threadsafe(self._begin_restart, rank, reason)

    def _begin_restart(self, rank: int, reason: str) -> None:
        if self._waves is not None:
            self._waves.rank_died(rank, reason)  # the whole DP group restarts
            return
        self.ranks_down([rank])
        self.spawn(self._restart(rank))

    def restart_dp_group(self, reason: str) -> bool:
        """Restart every rank of a DLO AllGather group; False when the stage has none."""
        if self._waves is None:
            return False
        self._waves.recover(reason)
        return True

    def ranks_down(self, ranks: Iterable[int]) -> None:
        self._dead_ranks.update(ranks)
        if not self.serving and self._on_health is not None:
            self._on_health(False)

    async def ranks_up(self, ranks: Iterable[int]) -> None:
        """Restarted ranks serve again (and sleep again if the stage sleeps)."""
        self._dead_ranks.difference_update(ranks)
        self._wake.set()
        for rank in ranks:
            if self.on_worker_restarted is not None:
                await self.on_worker_restarted(rank)
        if self._on_health is not None:
            self._on_health(True)

    async def _restart(self, rank: int) -> None:
        for attempt, delay in RESTART_BACKOFF.schedule():
            try:
                await asyncio.to_thread(self._executor.restart, rank)
            except errors.StagemeshError as exc:
                log.error("worker restart failed", rank=rank, attempt=attempt, error=str(exc))
                await asyncio.sleep(delay)
                continue
            log.info("worker restarted", rank=rank, attempt=attempt)
            await self.ranks_up([rank])
            return
        log.error("worker stays down after repeated restart failures", rank=rank)

"""Admission, dispatch to free worker groups, restart of dead ones.

A worker group (executor/group.py) is the unit of dispatch: one process, the TP ranks of one
model, or a DLO AllGather group that runs DP waves. A dispatcher forms what a group runs: a
batch of compatible requests (BatchDispatcher below) or a wave (waves_scheduler.py).

Runs on the service's event loop; all blocking work happens in the executor's processes or
in threads.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import torch

from stagemesh.core import errors, logs, tracing
from stagemesh.core.backoff import Backoff
from stagemesh.core.params import Params
from stagemesh.stage_service.engine import spans
from stagemesh.stage_service.engine.image_groups import ImageGroups
from stagemesh.stage_service.engine.request import Batch, Dispatcher, OutputsEvent, ProgressEvent, StageRequest
from stagemesh.stage_service.engine.waves_scheduler import WaveScheduler
from stagemesh.stage_service.executor.multiproc import BatchItemFailed, Executor, ProgressFn
from stagemesh.stage_service.executor.outputs import output_timeout
from stagemesh.stage_service.models.batch_invariance import BATCHED_KINDS, padding_key

log = logs.get_logger("stagemesh.engine")

RESTART_BACKOFF = Backoff((0.5, 1.0, 2.0, 5.0, 10.0))
DISPATCH_DEPTH = 2


class BatchDispatcher:
    """Batches of compatible requests, up to DISPATCH_DEPTH per group, so the next batch already
    waits in the worker's queue when a forward pass ends."""

    depth = DISPATCH_DEPTH

    def __init__(self, engine: Engine, kind: str, max_batch_size: int, batch_invariant: bool = False) -> None:
        self._engine = engine
        self._kind = kind
        self._max_batch = max(1, max_batch_size)
        # The runner pads a batch_invariant pass to fixed shapes: only requests whose inputs pad
        # alike share one, or the runner splits the batch into several passes.
        self._same_padding = batch_invariant

    def admit(self, req: StageRequest) -> None:
        pass  # every validated request runs in some batch

    def _compatible(self, a: StageRequest, b: StageRequest) -> bool:
        if self._kind not in BATCHED_KINDS:
            return True
        # A denoising stage samples a batch as one: same size, steps and guidance.
        if a.params.batch_key() != b.params.batch_key():
            return False
        return not self._same_padding or padding_key(a.inputs) == padding_key(b.inputs)

    def take(self, waiting: collections.deque[StageRequest]) -> list[StageRequest]:
        if waiting[0].images > 1:  # more images of the head's Generate may be on their way
            hold = self._engine.groups.hold_for(waiting[0], waiting, self._max_batch, self._engine.now())
            if hold > 0:
                self._engine.wake_after(hold)
                return []
        head = waiting.popleft()
        batch, rest = [head], []
        while waiting:
            r = waiting.popleft()
            if len(batch) < self._max_batch and self._compatible(head, r):
                batch.append(r)
            else:
                rest.append(r)
        waiting.extend(rest)
        return batch

    async def run(self, group: int, requests: list[StageRequest]) -> None:
        await self._engine.execute_batch(Batch(group, requests))


class Engine:
    def __init__(
        self,
        executor: Executor,
        kind: str,
        max_batch_size: int,
        max_queue: int,
        on_health: Callable[[bool], Any] | None = None,
        batch_invariant: bool = False,
    ):
        self._executor = executor
        self._max_queue = max_queue
        self._waiting: collections.deque[StageRequest] = collections.deque()
        # Dispatches handed to each worker group and not yet answered (COMPUTE_DONE).
        self._in_flight: dict[int, int] = {g.index: 0 for g in executor.groups}
        self._dead_groups: set[int] = set()
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_health = on_health
        self._tasks: set[asyncio.Task] = set()
        self._closed_reason: str | None = None  # set while the stage sleeps: new requests refused
        self._active_batches = 0
        self._admitted = 0  # requests inside run(): waiting, running or delivering
        self.batches = 0  # batches handed to worker groups (DP waves not counted)
        self.batched_requests = 0  # requests in those batches
        self._idle = asyncio.Event()
        self._idle.set()
        self.groups = ImageGroups()
        self.on_worker_restarted: Callable[[int], Awaitable[None]] | None = None  # with the group's index
        self.dispatcher: Dispatcher = (
            WaveScheduler(self, executor)
            if any(g.waves for g in executor.groups)
            else BatchDispatcher(self, kind, max_batch_size, batch_invariant)
        )

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
        return len(self._dead_groups) < len(self._in_flight)

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
        self,
        request_id: str,
        params: Params,
        inputs: dict[str, torch.Tensor],
        explicit_steps: bool = True,
        images: int = 1,
    ) -> AsyncIterator[Any]:
        """Admit one request; yield ProgressEvents then one OutputsEvent. Cancelling the
        consumer frees the request's place in the queue or in its batch. `images`: requests of
        this id sent at once, which wait for one another to share a batch (image_groups.py)."""
        if len(self._waiting) >= self._max_queue:
            raise errors.ResourceExhausted(f"stage queue is full ({self._max_queue} waiting); retry later")
        if self._closed_reason is not None:
            raise errors.FailedPrecondition(self._closed_reason)
        if not self.serving:
            raise errors.Unavailable("no worker of this stage is running")
        req = StageRequest(request_id, params, inputs, explicit_steps=explicit_steps, images=images, arrived=self.now())
        self.dispatcher.admit(req)
        if tracing.ON:
            req.trace = spans.RequestSpans(len(self._waiting))
        self._waiting.append(req)
        self._admitted += 1
        self.groups.join(req)
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
            self.groups.leave(req)
            req.done = True
            if req.trace is not None:
                req.trace.finished(spans.LEFT)  # a no-op once its outputs or error came
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

    def live_groups(self) -> list[int]:
        return [g for g in self._in_flight if g not in self._dead_groups]

    def restarting_groups(self) -> list[int]:
        return [g for g in self._in_flight if g in self._dead_groups]

    def live_ranks(self) -> list[int]:
        """The output ranks of the groups that serve."""
        return [r for g in self.live_groups() for r in self._executor.groups[g].output_ranks]

    # scheduling -------------------------------------------------------------------------------
    async def _schedule(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting and (group := self._free_group()) is not None:
                batch = self.dispatcher.take(self._waiting)
                if not batch:
                    break  # held back for a moment; the dispatcher asked for a wake-up
                if tracing.ON:
                    spans.dispatched(batch, group, "dp_wave" if isinstance(self.dispatcher, WaveScheduler) else "batch")
                self._in_flight[group] += 1
                self._launch(self.dispatcher.run(group, batch))

    def _free_group(self) -> int | None:
        free = [g for g, n in self._in_flight.items() if n < self.dispatcher.depth and g not in self._dead_groups]
        return min(free, key=self._in_flight.__getitem__) if free else None

    def _launch(self, work: Awaitable[None]) -> None:
        # Busy from here, not from when the task first runs: a close_admission() in between must
        # wait for this work, or its control message would overtake it to the worker.
        self._active_batches += 1
        self._idle.clear()
        self.spawn(self._run_active(work))

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
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
        assert loop is not None, "the engine was started"

        def on_progress(step: int, total: int) -> None:  # pump thread
            loop.call_soon_threadsafe(self._fan_out, requests, ProgressEvent(step, total))

        return on_progress

    async def execute_batch(self, batch: Batch) -> None:
        for r in batch.requests:
            r.batch = batch
        self.batches += 1
        self.batched_requests += len(batch.requests)
        on_progress = self.progress_listener(batch.requests)
        batch.rpc_id, fut = self._executor.submit(batch.group, [r.work_item() for r in batch.requests], on_progress)
        try:
            done = await asyncio.wrap_future(fut)
        except BatchItemFailed as exc:
            self._run_again_without(batch.requests, exc)
            return
        except Exception as exc:  # noqa: BLE001 - every request of the batch gets the error
            self._fan_out(batch.requests, exc)
            return
        finally:
            # COMPUTE_DONE (or the synchronous result) frees the group for the next batch at once.
            self.release(batch.group)
        await self.collect(batch.requests, done)

    def _run_again_without(self, requests: list[StageRequest], failed: BatchItemFailed) -> None:
        """One request alone made its batch fail: it gets the error, the others go back to the
        head of the queue and run without it."""
        self.deliver(requests[failed.index], failed.error)
        others = [r for i, r in enumerate(requests) if i != failed.index and not r.done]
        for r in others:
            r.batch = None
            if r.trace is not None:
                r.trace.requeued(f"ABORTED: a batch mate's input failed the batch ({failed.error}); queued again")
        self._waiting.extendleft(reversed(others))
        self._wake.set()

    async def collect(self, requests: list[StageRequest], done: Any) -> None:
        """Hand each request its outputs: a step-mode result carries them, a COMPUTE_DONE names
        the batch output to split."""
        if tracing.ON:
            spans.computed(requests, done)
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

    def release(self, group: int) -> None:
        self._in_flight[group] = max(0, self._in_flight[group] - 1)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def wake_after(self, delay_s: float) -> None:
        asyncio.get_running_loop().call_later(delay_s, self._wake.set)

    def _fan_out(self, requests: list[StageRequest], event: Any) -> None:
        for r in requests:
            self.deliver(r, event)

    @staticmethod
    def deliver(req: StageRequest, event: Any) -> None:
        if not req.done:
            req.events.put_nowait(event)
            if req.trace is not None and not isinstance(event, ProgressEvent):
                req.trace.finished(tracing.describe(event) if isinstance(event, BaseException) else None)

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
            self._executor.cancel(batch.group, batch.rpc_id)

    # group death and restart ------------------------------------------------------------------
    def worker_died(self, group: int, reason: str) -> None:
        """Called from the executor's pump thread."""
        assert self._loop is not None, "the engine was started"
        self._loop.call_soon_threadsafe(self.restart_group, group, reason)

    def restart_group(self, group: int, reason: str) -> None:
        """Take a group out of dispatch and restart all its processes (once, however many ask)."""
        if group in self._dead_groups:
            return
        log.error("worker group down; restarting it", group=group, reason=reason)
        self._dead_groups.add(group)
        if not self.serving and self._on_health is not None:
            self._on_health(False)
        self.spawn(self._restart(group))

    async def _restart(self, group: int) -> None:
        for attempt, delay in RESTART_BACKOFF.schedule():
            try:
                await asyncio.to_thread(self._executor.restart, group)
            except Exception as exc:  # noqa: BLE001 - retried with backoff, never left half-done
                log.error("worker restart failed", group=group, attempt=attempt, error=str(exc))
                await asyncio.sleep(delay)
                continue
            log.info("worker restarted", group=group, attempt=attempt)
            await self._group_up(group)
            return
        log.error("worker group stays down after repeated restart failures", group=group)
        if not self.serving:
            self.fail_waiting(errors.Unavailable(f"{self._executor.stage_name}: no worker could be restarted"))

    async def _group_up(self, group: int) -> None:
        """A restarted group serves again once the stage has made it like its others (asleep if
        the stage sleeps, holding the stage's adapters): no batch reaches it before."""
        try:
            if self.on_worker_restarted is not None:
                await self.on_worker_restarted(group)
        finally:
            self._dead_groups.discard(group)
            self._wake.set()
        if self._on_health is not None:
            self._on_health(True)

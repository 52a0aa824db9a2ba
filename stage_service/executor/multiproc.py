"""Worker processes in groups (group.py), their queues, one result pump per worker, and futures per RPC."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing as mp
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from stagemesh.core import errors, logs
from stagemesh.stage_service.executor import worker_startup
from stagemesh.stage_service.executor.group import (
    GroupCall,
    PendingCall,
    ProgressFn,
    WorkerGroup,
    WorkerProcess,
    build_groups,
    first_answer,
)
from stagemesh.stage_service.executor.outputs import OutputRegistry, resolve_future
from stagemesh.stage_service.models.contract import WorkItem
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.transport import ipc, protocol

log = logs.get_logger("stagemesh.executor")

PUMP_POLL_S = 0.1
READY_TIMEOUT_S = worker_startup.READY_TIMEOUT_S
JOIN_TIMEOUT_S = worker_startup.JOIN_TIMEOUT_S

DeathFn = Callable[[int, str], None]  # (group index, reason)


class BatchItemFailed(errors.StagemeshError):
    """Item `index` of a batch could not run and nothing of the batch ran: `error` is for that
    item's request; the others may run again without it."""

    def __init__(self, index: int, error: errors.StagemeshError) -> None:
        super().__init__(str(error))
        self.index = index
        self.error = error


class StepOutputs(list):
    """A step-mode batch's answer: its outputs (one dict per item, as a list) and when the worker
    computed them."""

    def __init__(self, outputs: list[Any], timing: protocol.BatchTiming | None) -> None:
        super().__init__(outputs)
        self.timing = timing


class Executor:
    def __init__(
        self, settings: StageSettings, on_death: DeathFn | None = None, spawned: list[WorkerGroup] | None = None
    ):
        """`spawned`: the stage's groups with their processes already started (executor.early);
        start() then waits for them instead of spawning."""
        self.stage_name = f"stage {settings.stage_id} ({settings.kind})"
        self.hang_timeout_s = settings.hang_timeout_s
        self.groups: list[WorkerGroup] = spawned if spawned is not None else build_groups(settings, os.getpid())
        self.outputs = OutputRegistry(self.stage_name)
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._on_death = on_death
        self._closed = False
        self.offload_bytes_streamed = 0  # every worker's DLO host -> device bytes, restarts included
        self.compute_seconds = 0.0  # device time of every forward pass whose outputs came back
        self.step_cache_skipped = 0  # block passes step caches skipped, every worker, restarts included
        self.step_cache_passes = 0  # block passes of the batches step caches ran on

    @property
    def _workers(self) -> dict[int, WorkerProcess]:
        """Every running process by rank."""
        return {w.spec.rank: w for g in self.groups for w in g.workers}

    # life cycle -----------------------------------------------------------------------------
    def start(self, timeout_s: float = READY_TIMEOUT_S) -> list[protocol.Ready]:
        """Start every group and wait until each rank has loaded its model (blocking)."""
        swept = ipc.sweep_orphans()
        if swept:
            log.warning("removed shared-memory segments of dead executors", count=swept)
        return self._start(self.groups, timeout_s)

    def restart(self, group: int, timeout_s: float = READY_TIMEOUT_S) -> list[protocol.Ready]:
        """Stop every process of a group (what they still owed fails now, their segments go) and
        start them again as a new group."""
        self._stop_group(self.groups[group], "restarted")
        return self._start([self.groups[group]], timeout_s)

    def shutdown(self) -> None:
        self._closed = True
        workers = [w for g in self.groups for w in g.workers]
        for w in workers:
            self._send_shutdown(w)  # every worker winds down at once, not one per join
        for w in workers:
            self._stop_worker(w, graceful=True)
        for g in self.groups:
            g.workers = []
        self.outputs.fail_all(errors.Unavailable(f"{self.stage_name}: executor shut down"))
        ipc.sweep(os.getpid())

    def ready_info(self) -> list[protocol.Ready]:
        return [w.ready for w in self._workers.values() if w.ready is not None]

    def device_memory_bytes(self) -> int:
        """Device memory of the workers, as each last reported it (at load, then with each reply)."""
        return sum(
            w.stats.device_memory_bytes if w.stats is not None else w.ready.device_memory_bytes
            for w in list(self._workers.values())
            if w.ready is not None
        )

    # calls ------------------------------------------------------------------------------------
    def submit(self, group: int, items: list[WorkItem], on_progress: ProgressFn | None = None) -> tuple[str, cf.Future]:
        """Run one batch on every process of the group; resolves with the output rank's answer."""
        g = self.groups[group]
        rpc_id = uuid.uuid4().hex
        call = self._call(g, rpc_id, [items] * g.size, [on_progress] * g.size, execute=True)
        return rpc_id, first_answer(call)

    def submit_wave(
        self, group: int, batches: Sequence[list[WorkItem]], listeners: Sequence[ProgressFn | None]
    ) -> list[cf.Future]:
        """A DP wave: batch i (and its progress listener) to rank i; one future per rank."""
        g = self.groups[group]
        return self._call(g, uuid.uuid4().hex, batches, listeners, execute=True).parts

    def control(self, group: int, op: str, **args: Any) -> cf.Future:
        """A control call to every process of a group; resolves with {output rank: its Ack's result}."""
        return self._control(group, op, args).future

    def control_each(self, group: int, op: str, **args: Any) -> dict[int, cf.Future]:
        """A control call to every process of a group; output rank -> its Ack's result."""
        return self._control(group, op, args).by_output_rank()

    def _control(self, group: int, op: str, args: dict[str, Any]) -> GroupCall:
        g = self.groups[group]
        return self._call(g, uuid.uuid4().hex, [op] * g.size, [None] * g.size, execute=False, args=args)

    def cancel(self, group: int, rpc_id: str) -> None:
        g = self.groups[group]
        if g.size > 1 or g.down_rank() is not None:
            # A rank that stopped between steps would leave the others in a collective: the
            # batch runs to its end and its output is dropped.
            return
        g.workers[0].requests.put(protocol.Cancel(rpc_id))

    def _call(
        self,
        g: WorkerGroup,
        rpc_id: str,
        payloads: Sequence[Any],
        listeners: Sequence[ProgressFn | None],
        execute: bool,
        args: dict[str, Any] | None = None,
    ) -> GroupCall:
        """The one primitive: a message to each process of `g`. Every process answers a control
        call; only output ranks answer a batch (the others run it with them and stay silent)."""
        down = g.specs[0].rank if self._closed else g.down_rank()
        if down is not None:
            exc = errors.Unavailable(f"{self.stage_name} worker {down} is not running")
            failed: list[cf.Future] = [cf.Future() for _ in g.output_ranks]
            for fut in failed:
                resolve_future(fut, exc=exc)
            return GroupCall(failed, g.output_ranks, g.output_ranks)
        answering = [w for w in g.workers if not execute or w.spec.output_rank]
        parts: list[cf.Future] = [cf.Future() for _ in answering]
        call = GroupCall(parts, [w.spec.rank for w in answering], g.output_ranks)
        with self._lock:
            for w, fut in zip(answering, parts):
                w.pending[rpc_id] = PendingCall(fut, listeners[g.workers.index(w)])
        for w, payload in zip(g.workers, payloads):
            if execute:
                # Packed per rank: each reader unlinks the shared-memory segments it unpacks.
                packed = [dataclasses.replace(item, inputs=ipc.pack(item.inputs)) for item in payload]
                w.requests.put(protocol.Execute(rpc_id, packed))
            else:
                w.requests.put(protocol.Control(rpc_id, payload, args or {}))
        return call

    # internals ------------------------------------------------------------------------------
    def _start(self, groups: list[WorkerGroup], timeout_s: float) -> list[protocol.Ready]:
        if self._closed:
            raise errors.Unavailable(f"{self.stage_name}: executor shut down")
        for g in groups:
            if not g.workers:  # else spawned at the stage's start (executor.early)
                g.workers = [self._spawn(spec, g.index) for spec in g.fresh_specs(timeout_s)]
        try:
            return self._await_all_ready([w for g in groups for w in g.workers], timeout_s)
        except errors.Unavailable:
            for g in groups:
                # The others wait in the group for the rank that failed: they never get ready.
                self._stop_group(g, "its group failed to start")
            raise

    def _stop_group(self, g: WorkerGroup, reason: str) -> None:
        for w in g.workers:
            w.stopping = True  # before any kill: a peer's death is no news while we stop them all
        for w in g.workers:
            self._stop_worker(w, graceful=False, reason=reason)
        for rank in g.ranks:
            # What the old processes still owed fails now (a death the pump had not noticed yet
            # never reached _worker_died), and their segments go.
            self.outputs.fail_rank(rank, errors.Unavailable(f"{self.stage_name} worker {rank}: {reason}"))
            ipc.sweep(os.getpid(), rank)
        g.workers = []

    def _spawn(self, spec: protocol.WorkerSpec, group: int) -> WorkerProcess:
        process, requests, results = worker_startup.spawn(self._ctx, spec)
        log.info("worker started", rank=spec.rank, pid=process.pid)
        return WorkerProcess(spec, process, requests, results, group=group)

    def _await_all_ready(self, workers: list[WorkerProcess], timeout_s: float) -> list[protocol.Ready]:
        by_rank = {w.spec.rank: w for w in workers}
        for rank, ready in worker_startup.wait_ready(self.stage_name, by_rank, timeout_s):
            w = by_rank[rank]
            w.ready = ready
            # From here on the pump is the only reader of the worker's result queue.
            w.pump = threading.Thread(target=self._pump, args=(w,), name=f"result-pump-{rank}", daemon=True)
            w.pump.start()
            log.info("worker ready", rank=rank, device=ready.device)
        return [w.ready for w in workers if w.ready is not None]

    def _pump(self, w: WorkerProcess) -> None:
        """The only reader of a worker's result queue, and its watchdog."""
        w.last_heard = time.monotonic()
        while True:
            try:
                msg = w.results.get(timeout=PUMP_POLL_S)
            except queue.Empty:
                if w.process.is_alive():
                    self._kill_if_hung(w)
                    continue
                self._worker_died(w)
                return
            except EOFError:  # the worker closed its end: it is exiting (or gone)
                w.process.join(PUMP_POLL_S)
                self._worker_died(w)
                return
            except (OSError, ValueError):
                return  # pipe closed by shutdown
            self._dispatch(w, msg)

    def _kill_if_hung(self, w: WorkerProcess) -> None:
        """A live process that sent nothing, not even a heartbeat, for hang_timeout_s is stopped
        (SIGSTOP) or stuck where its threads cannot run: kill it, so its death restarts the group."""
        silent = time.monotonic() - w.last_heard
        if silent <= self.hang_timeout_s or w.stopping or w.hung_for:
            return
        w.hung_for = silent
        log.error("worker hung; killing it", rank=w.spec.rank, pid=w.process.pid, silent_s=round(silent, 1))
        w.process.kill()

    def _dispatch(self, w: WorkerProcess, msg: Any) -> None:
        w.last_heard = time.monotonic()
        if isinstance(msg, protocol.Heartbeat):
            return
        if isinstance(msg, protocol.Progress):
            with self._lock:
                pending = w.pending.get(msg.rpc_id)
            if pending is not None and pending.on_progress is not None:
                try:
                    pending.on_progress(msg.step, msg.total)
                except Exception:  # a listener's failure must not kill the pump
                    log.exception("progress callback failed", rpc_id=msg.rpc_id)
            return
        if isinstance(msg, (protocol.OutputReady, protocol.Result)):
            with self._lock:  # one pump thread per worker: they may add at the same time
                self.compute_seconds += msg.compute_seconds
        if isinstance(msg, protocol.OutputReady):
            self._output_ready(msg)
            return
        if getattr(msg, "stats", None) is not None:
            self._note_stats(w, msg.stats)
        if isinstance(msg, protocol.ComputeDone):
            # Registered before the RPC future resolves, so a death in between fails the output too.
            self.outputs.expect(msg.async_output_id, w.spec.rank)
        with self._lock:
            pending = w.pending.pop(getattr(msg, "rpc_id", ""), None)
        if pending is None:
            if isinstance(msg, protocol.ComputeDone):
                self.outputs.discard(msg.async_output_id)  # nobody will ever ask for this output
            return
        if isinstance(msg, protocol.ComputeDone):
            if not resolve_future(pending.future, result=msg):
                # The caller cancelled the RPC: nobody will split or wait for its output, so
                # drop it when it arrives instead of caching it forever.
                self.outputs.discard(msg.async_output_id)
        elif isinstance(msg, protocol.Ack):
            exc = errors.StagemeshError(f"{self.stage_name} worker {w.spec.rank}: {msg.error}") if msg.error else None
            resolve_future(pending.future, result=msg.result, exc=exc)
        elif isinstance(msg, protocol.Result):
            try:
                outputs = [ipc.unpack(o) for o in msg.outputs]
            except Exception as exc:  # noqa: BLE001 - a bad payload fails its request, not the pump
                ipc.discard(msg.outputs)
                resolve_future(
                    pending.future, exc=errors.StagemeshError(f"{self.stage_name}: could not unpack result: {exc}")
                )
            else:
                resolve_future(pending.future, result=StepOutputs(outputs, msg.timing))
        elif isinstance(msg, protocol.Failure):
            resolve_future(pending.future, exc=self._failure(w, msg))

    def _failure(self, w: WorkerProcess, msg: protocol.Failure) -> errors.StagemeshError:
        if msg.cancelled:
            return errors.Cancelled(msg.message)
        if msg.item is not None:
            return BatchItemFailed(msg.item, errors.InvalidArgument.field("inputs", msg.message))
        # The worker's words may name an exception class or the other requests of the batch: they
        # go to the log (the worker logged the stack), the callers learn what failed.
        log.error("batch failed in a worker", rank=w.spec.rank, error=msg.message)
        if self.groups[w.group].size > 1:
            # A rank of a collective group fails when a peer dies under it, and then exits itself:
            # either way the group is going down and restarts, which is what the caller should hear.
            return errors.Unavailable(
                f"{self.stage_name} worker {w.spec.rank} failed with its group; the group restarts"
            )
        return errors.StagemeshError(f"{self.stage_name} failed to run a batch; the stage log has the details")

    def _note_stats(self, w: WorkerProcess, stats: protocol.WorkerStats) -> None:
        # The worker's offload count is cumulative; it starts again from 0 in a new process (a new
        # WorkerProcess) or a rebuilt DLO engine (a smaller value).
        last = w.stats or protocol.WorkerStats()
        with self._lock:  # one pump thread per worker: they may add at the same time
            self.offload_bytes_streamed += _grown(last.offload_bytes, stats.offload_bytes)
            self.step_cache_skipped += _grown(last.step_cache_skipped, stats.step_cache_skipped)
            self.step_cache_passes += _grown(last.step_cache_passes, stats.step_cache_passes)
        w.stats = stats

    def _output_ready(self, msg: protocol.OutputReady) -> None:
        # Unpack first, whoever waits: a shared-memory segment never outlives its reader.
        if msg.error is not None:
            self.outputs.deliver(
                msg.async_output_id, exc=errors.StagemeshError(f"{self.stage_name}: output failed: {msg.error}")
            )
            return
        try:
            result = [ipc.unpack(item) for item in msg.payload]
        except Exception as exc:  # noqa: BLE001 - a bad payload fails its request, not the pump
            ipc.discard(msg.payload)
            self.outputs.deliver(
                msg.async_output_id, exc=errors.StagemeshError(f"{self.stage_name}: could not unpack output: {exc}")
            )
            return
        self.outputs.deliver(msg.async_output_id, result)

    def _worker_died(self, w: WorkerProcess) -> None:
        """One dead process takes its group down: everything the group owed fails now, and the
        stage is told so it restarts the group as a whole."""
        if self._closed or w.stopping:
            return
        group = self.groups[w.group]
        if w.hung_for:
            reason = f"{self.stage_name} worker {w.spec.rank} was hung (silent for {w.hung_for:.0f} s) and was killed"
        else:
            reason = f"{self.stage_name} worker {w.spec.rank} died (exit code {w.process.exitcode})"
        log.error("worker died", rank=w.spec.rank, exitcode=w.process.exitcode, hung=bool(w.hung_for))
        for peer in group.workers:
            peer.stopping = True  # the peers' deaths during the restart are no news
        for peer in group.workers:
            self._fail_pending(peer, errors.Unavailable(reason))
            self.outputs.fail_rank(peer.spec.rank, errors.Unavailable(reason))
        ipc.sweep(os.getpid(), w.spec.rank)
        if self._on_death is not None:
            self._on_death(group.index, reason)

    def _fail_pending(self, w: WorkerProcess, exc: BaseException) -> None:
        with self._lock:
            pending, w.pending = w.pending, {}
        for p in pending.values():
            resolve_future(p.future, exc=exc)

    def _send_shutdown(self, w: WorkerProcess) -> None:
        w.stopping = True
        if w.shutdown_sent or not w.process.is_alive():
            return
        w.shutdown_sent = True
        try:
            w.requests.put(protocol.Shutdown())
        except (OSError, ValueError):
            pass  # a broken queue: the join times out and the process is killed

    def _stop_worker(self, w: WorkerProcess, graceful: bool, reason: str = "executor shut down") -> None:
        w.stopping = True
        if graceful and w.process.is_alive():
            self._send_shutdown(w)
            w.process.join(JOIN_TIMEOUT_S)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(JOIN_TIMEOUT_S)
        self._fail_pending(w, errors.Unavailable(f"{self.stage_name} worker {w.spec.rank}: {reason}"))
        w.requests.cancel_join_thread()  # a dead reader must not block our exit
        w.requests.close()
        w.results.close()
        if w.pump is not None and w.pump is not threading.current_thread():
            w.pump.join(JOIN_TIMEOUT_S)


def _grown(before: int, now: int) -> int:
    """What a worker's cumulative count grew by; a smaller value is a fresh count (a new process)."""
    return now - before if now >= before else now

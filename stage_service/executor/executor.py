"""Worker processes, their queues, one result pump per worker, and futures per RPC."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing as mp
import os
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stage_service.executor import worker_startup
from stage_service.executor.outputs import OutputRegistry, resolve_future
from stage_service.models.contract import WorkItem
from stage_service.offload.config import DloOptions
from stage_service.transport import ipc, protocol
from stagemesh.core import errors, logs
from stagemesh.core.procutil import free_port

log = logs.get_logger("stagemesh.executor")

PUMP_POLL_S = 0.1
READY_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 10.0

ProgressFn = Callable[[int, int], None]
DeathFn = Callable[[int, str], None]


@dataclass
class _Pending:
    future: cf.Future
    on_progress: ProgressFn | None


@dataclass
class _Worker:
    spec: protocol.WorkerSpec
    process: mp.Process
    requests: Any
    results: Any
    pending: dict[str, _Pending] = field(default_factory=dict)
    pump: threading.Thread | None = None
    ready: protocol.Ready | None = None
    stats: protocol.WorkerStats | None = None  # from the worker's latest reply
    stopping: bool = False


class Executor:
    def __init__(
        self,
        stage_id: int,
        kind: str,
        model_dir: str,
        device: str,
        workers: int,
        threads: int = 0,
        on_death: DeathFn | None = None,
        step_execution: bool = False,
        dlo: dict | None = None,
        cuda_graphs: bool = True,
    ):
        self.stage_name = f"stage {stage_id} ({kind})"
        self.step_execution = step_execution
        opts = DloOptions.from_mapping(dlo)
        # DLO AllGather: the ranks form one process group and take requests in DP waves.
        self.wave_size = opts.dp_size if kind == "diffusion" and opts.forms_dp_group else 1
        if self.wave_size > 1 and workers != self.wave_size:
            raise ValueError(
                f"{self.stage_name}: dp_size = {self.wave_size} with DLO AllGather "
                f"runs {self.wave_size} worker processes, got workers = {workers}"
            )
        # Tensor parallelism: the processes are the TP ranks of one model. The engine sees one
        # worker (rank 0); every batch and control call goes to all ranks, rank 0 answers.
        self.tp_size = opts.tensor_parallel_size
        if self.tp_size > 1 and (kind != "diffusion" or workers != self.tp_size or self.wave_size > 1):
            raise ValueError(
                f"{self.stage_name}: tensor_parallel_size = {self.tp_size} needs a "
                f"diffusion stage with {self.tp_size} worker processes and no DP "
                f"group (got kind {kind!r}, workers = {workers})"
            )
        self.engine_workers = 1 if self.tp_size > 1 else workers
        self._specs = [
            protocol.WorkerSpec(
                rank,
                stage_id,
                kind,
                str(model_dir),
                device,
                os.getpid(),
                threads,
                step_execution,
                cuda_graphs=cuda_graphs,
                dlo=dict(dlo or {}),
            )
            for rank in range(workers)
        ]
        self.outputs = OutputRegistry(self.stage_name)
        self._ctx = mp.get_context("spawn")
        self._workers: dict[int, _Worker] = {}
        self._lock = threading.Lock()
        self._on_death = on_death
        self._closed = False
        self.offload_bytes_streamed = 0  # every worker's DLO host -> device bytes, restarts included
        self.compute_seconds = 0.0  # device time of every forward pass whose outputs came back

    # life cycle -----------------------------------------------------------------------------
    def start(self, timeout_s: float = READY_TIMEOUT_S) -> list[protocol.Ready]:
        """Start every worker and wait until each has loaded its model (blocking)."""
        swept = ipc.sweep_orphans()
        if swept:
            log.warning("removed shared-memory segments of dead executors", count=swept)
        return self._start_all(timeout_s)

    def restart(self, rank: int, timeout_s: float = READY_TIMEOUT_S) -> protocol.Ready:
        if self.wave_size > 1 or self.tp_size > 1:
            return self.restart_group(timeout_s)[rank]
        old = self._workers.get(rank)
        if old is not None:
            self._stop_worker(old, graceful=False, reason="restarted")
            # If the pump had not noticed a death yet (or the worker was alive), _worker_died never
            # ran: what the old worker still owed must fail now, and its segments must go.
            self.outputs.fail_rank(rank, errors.Unavailable(f"{self.stage_name} worker {rank} was restarted"))
            ipc.sweep(os.getpid(), rank)
        self._spawn(self._specs[rank])
        return self._await_ready(rank, timeout_s)

    def restart_group(self, timeout_s: float = READY_TIMEOUT_S) -> list[protocol.Ready]:
        """Stop every rank and start them as a new process group: a group with a dead or hung
        member cannot be repaired one rank at a time (its collectives would never complete)."""
        self._stop_all("restarted with its DP group")
        return self._start_all(timeout_s)

    def is_alive(self, rank: int) -> bool:
        w = self._workers.get(rank)
        return w is not None and not w.stopping and w.process.is_alive()

    def shutdown(self) -> None:
        self._closed = True
        for w in list(self._workers.values()):
            self._stop_worker(w, graceful=True)
        self._workers.clear()
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

    # requests -------------------------------------------------------------------------------
    def submit(self, rank: int, items: list[WorkItem], on_progress: ProgressFn | None = None) -> tuple[str, cf.Future]:
        rpc_id = uuid.uuid4().hex
        fut: cf.Future = cf.Future()
        w = self._workers.get(rank)
        if w is None or not w.process.is_alive() or self._closed:
            resolve_future(fut, exc=errors.Unavailable(f"{self.stage_name} worker {rank} is not running"))
            return rpc_id, fut
        with self._lock:
            w.pending[rpc_id] = _Pending(fut, on_progress)
        for target in self._group_of(w):
            # Packed per rank: each reader unlinks the shared-memory segments it unpacks.
            packed = [dataclasses.replace(item, inputs=ipc.pack(item.inputs)) for item in items]
            target.requests.put(protocol.Execute(rpc_id, packed))
        return rpc_id, fut

    def _group_of(self, w: _Worker) -> list[_Worker]:
        """The processes a call to `w` reaches: all TP ranks (rank 0 first), else `w` alone."""
        if self.tp_size == 1:
            return [w]
        return [self._workers[r] for r in sorted(self._workers)]

    def control(self, rank: int, op: str, **args: Any) -> cf.Future:
        """Send a control call to one worker; the future resolves with its Ack's result."""
        rpc_id = uuid.uuid4().hex
        fut: cf.Future = cf.Future()
        w = self._workers.get(rank)
        if w is None or not w.process.is_alive() or self._closed:
            resolve_future(fut, exc=errors.Unavailable(f"{self.stage_name} worker {rank} is not running"))
            return fut
        if self.tp_size > 1:
            return self._control_all(op, args)
        with self._lock:
            w.pending[rpc_id] = _Pending(fut, None)
        w.requests.put(protocol.Control(rpc_id, op, args))
        return fut

    def _control_all(self, op: str, args: dict[str, Any]) -> cf.Future:
        """A control call to every TP rank; resolves with rank 0's result once all answered,
        or with the first error."""
        combined: cf.Future = cf.Future()
        parts: list[cf.Future] = []
        for w in self._group_of(self._workers[0]):
            fut: cf.Future = cf.Future()
            rpc_id = uuid.uuid4().hex
            with self._lock:
                w.pending[rpc_id] = _Pending(fut, None)
            w.requests.put(protocol.Control(rpc_id, op, args))
            parts.append(fut)

        def settle(_: cf.Future) -> None:
            if not all(p.done() for p in parts):
                return
            failed = next((p.exception() for p in parts if p.exception() is not None), None)
            resolve_future(combined, result=None if failed else parts[0].result(), exc=failed)

        for p in parts:
            p.add_done_callback(settle)
        return combined

    def cancel(self, rank: int, rpc_id: str) -> None:
        if self.tp_size > 1:
            # A TP rank that stopped between steps would leave the others in a collective:
            # the batch runs to its end and its output is dropped.
            return
        w = self._workers.get(rank)
        if w is not None and w.process.is_alive():
            w.requests.put(protocol.Cancel(rpc_id))

    # internals ------------------------------------------------------------------------------
    def _start_all(self, timeout_s: float) -> list[protocol.Ready]:
        if self._closed:
            raise errors.Unavailable(f"{self.stage_name}: executor shut down")
        specs = self._specs
        if self.wave_size > 1 or self.tp_size > 1:
            # A fresh rendezvous for every start: the old group's port may still be held.
            group = protocol.DpGroup(f"tcp://127.0.0.1:{free_port()}", len(specs), timeout_s)
            key = "dp_group" if self.wave_size > 1 else "tp_group"
            specs = [dataclasses.replace(spec, **{key: group}) for spec in specs]
        for spec in specs:
            self._spawn(spec)
        try:
            return self._await_all_ready(sorted(self._workers), timeout_s)
        except errors.Unavailable:
            if self.wave_size > 1 or self.tp_size > 1:
                # The others wait in the group for the rank that failed: they never get ready.
                self._stop_all("its DP group failed to form")
            raise

    def _stop_all(self, reason: str) -> None:
        workers = list(self._workers.values())
        for w in workers:
            w.stopping = True  # before any kill: a peer's death is no news while we stop them all
        for w in workers:
            self._stop_worker(w, graceful=False, reason=reason)
            self.outputs.fail_rank(w.spec.rank, errors.Unavailable(f"{self.stage_name} worker {w.spec.rank}: {reason}"))
            ipc.sweep(os.getpid(), w.spec.rank)

    def _spawn(self, spec: protocol.WorkerSpec) -> None:
        process, requests, results = worker_startup.spawn(self._ctx, spec)
        self._workers[spec.rank] = _Worker(spec, process, requests, results)
        log.info("worker started", rank=spec.rank, pid=process.pid)

    def _await_ready(self, rank: int, timeout_s: float) -> protocol.Ready:
        return self._await_all_ready([rank], timeout_s)[0]

    def _await_all_ready(self, ranks: list[int], timeout_s: float) -> list[protocol.Ready]:
        workers = {rank: self._workers[rank] for rank in ranks}
        for rank, ready in worker_startup.wait_ready(self.stage_name, workers, timeout_s):
            w = workers[rank]
            w.ready = ready
            # From here on the pump is the only reader of the worker's result queue.
            w.pump = threading.Thread(target=self._pump, args=(w,), name=f"result-pump-{rank}", daemon=True)
            w.pump.start()
            log.info("worker ready", rank=rank, device=ready.device)
        return [w.ready for w in workers.values()]

    def _pump(self, w: _Worker) -> None:
        """The only reader of a worker's result queue."""
        while True:
            try:
                msg = w.results.get(timeout=PUMP_POLL_S)
            except queue.Empty:
                if w.process.is_alive():
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

    def _dispatch(self, w: _Worker, msg: Any) -> None:
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
                resolve_future(pending.future, result=outputs)
        elif isinstance(msg, protocol.Failure):
            exc = (
                errors.Cancelled(msg.message)
                if msg.cancelled
                else errors.StagemeshError(f"{self.stage_name} failed: {msg.message}")
            )
            resolve_future(pending.future, exc=exc)

    def _note_stats(self, w: _Worker, stats: protocol.WorkerStats) -> None:
        # The worker's offload count is cumulative; it starts again from 0 in a new process (a new
        # _Worker) or a rebuilt DLO engine (a smaller value).
        before = w.stats.offload_bytes if w.stats is not None else 0
        grown = stats.offload_bytes - before if stats.offload_bytes >= before else stats.offload_bytes
        with self._lock:  # one pump thread per worker: they may add at the same time
            self.offload_bytes_streamed += grown
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

    def _worker_died(self, w: _Worker) -> None:
        if self._closed or w.stopping:
            return
        reason = f"{self.stage_name} worker {w.spec.rank} died (exit code {w.process.exitcode})"
        log.error("worker died", rank=w.spec.rank, exitcode=w.process.exitcode)
        if self.tp_size > 1:
            self._tp_rank_died(reason)
            return
        self._fail_pending(w, errors.Unavailable(reason))
        self.outputs.fail_rank(w.spec.rank, errors.Unavailable(reason))
        ipc.sweep(os.getpid(), w.spec.rank)
        if self._on_death is not None:
            self._on_death(w.spec.rank, reason)

    def _tp_rank_died(self, reason: str) -> None:
        """One dead TP rank takes the group down: the engine restarts it as a whole (rank 0)."""
        group = list(self._workers.values())
        for w in group:
            w.stopping = True  # the peers' deaths during the restart are no news
        for w in group:
            self._fail_pending(w, errors.Unavailable(reason))
        self.outputs.fail_rank(0, errors.Unavailable(reason))
        if self._on_death is not None:
            self._on_death(0, reason)

    def _fail_pending(self, w: _Worker, exc: BaseException) -> None:
        with self._lock:
            pending, w.pending = w.pending, {}
        for p in pending.values():
            resolve_future(p.future, exc=exc)

    def _stop_worker(self, w: _Worker, graceful: bool, reason: str = "executor shut down") -> None:
        w.stopping = True
        if graceful and w.process.is_alive():
            try:
                w.requests.put(protocol.Shutdown())
            except (OSError, ValueError):
                pass
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

"""One worker process per rank: loads the model runner and executes batches from its queue.

Request mode (default): after the forward pass the worker records a device event, answers
COMPUTE_DONE at once and hands the outputs to the async output thread. Step mode
(`step_execution`): outputs are copied and packed here and sent as one RESULT.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from stagemesh.core import logs, startup
from stagemesh.stage_service import platform
from stagemesh.stage_service.models import acceleration, adapters, diffusers_adapter
from stagemesh.stage_service.models.acceleration import Acceleration
from stagemesh.stage_service.models.batch_invariance import BATCHED_KINDS, run_items_alone
from stagemesh.stage_service.models.contract import ItemError, Runner
from stagemesh.stage_service.models.model_dir import resolved_model_dir
from stagemesh.stage_service.models.runners import build_runner
from stagemesh.stage_service.settings import HEARTBEAT_S, DloOptions
from stagemesh.stage_service.transport import ipc, protocol, tensors
from stagemesh.stage_service.worker.adapter_loads import BackgroundLoads
from stagemesh.stage_service.worker.async_output import AsyncOutputThread, ResultWriter, new_output_id
from stagemesh.stage_service.worker.read_ahead import ReadAhead
from stagemesh.stage_service.worker.sleep import SleepController
from stagemesh.stage_service.worker.warm_up import WarmUpFailed, warm_up

log = logs.get_logger("stagemesh.worker")


class _CancelledByCaller(Exception):
    pass


class _Inbox:
    """The request queue, read so that a Cancel can be noticed between denoising steps."""

    def __init__(self, requests, on_dropped: Callable[[protocol.Execute], None]):
        self._requests = requests
        self._backlog: collections.deque = collections.deque()
        self._on_dropped = on_dropped  # answers a queued batch cancelled before it started

    def next(self):
        return self._backlog.popleft() if self._backlog else self._requests.get()

    def cancelled(self, rpc_id: str) -> bool:
        """Drain what arrived without blocking; True if `rpc_id` was cancelled."""
        hit = False
        while True:
            try:
                msg = self._requests.get_nowait()
            except queue.Empty:
                return hit
            if isinstance(msg, protocol.Cancel):
                if msg.rpc_id == rpc_id:
                    hit = True
                else:
                    self._drop_queued(msg.rpc_id)
            else:
                self._backlog.append(msg)

    def _drop_queued(self, rpc_id: str) -> None:
        """A queued batch cancelled before it started never runs, but it is answered: the
        executor's future and the engine's dispatch slot wait for that answer."""
        dropped = [m for m in self._backlog if isinstance(m, protocol.Execute) and m.rpc_id == rpc_id]
        self._backlog = collections.deque(m for m in self._backlog if m not in dropped)
        for msg in dropped:
            self._on_dropped(msg)


class _Heartbeat:
    """Tells the executor every HEARTBEAT_S that this process runs, even while a batch does: its
    silence is how the stage tells a stopped or stuck worker from a busy one."""

    def __init__(self, writer: ResultWriter) -> None:
        self._writer = writer
        self._stopped = threading.Event()
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            try:
                self._writer.put(protocol.Heartbeat())
            except (OSError, ValueError):  # the pipe closed: the worker is exiting
                return

    def stop(self) -> None:
        self._stopped.set()


def resolve_device(device: str, rank: int) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return f"cuda:{rank % torch.cuda.device_count()}"
    return device


class Worker:
    def __init__(
        self,
        spec: protocol.WorkerSpec,
        runner: Runner,
        device: str,
        requests,
        results,
        acceleration: Acceleration | None = None,
    ):
        # First, so that nothing else is made when it fails: "at_start" prepares the level-1
        # host buffer here, before the worker reports ready, and compacts the weights through it.
        settings = spec.settings
        self.sleep = SleepController(runner.weight_files(), device, host_buffer=settings.sleep_host_buffer)
        if settings.sleep_host_buffer == "at_start":
            started = time.perf_counter()
            self.sleep.compact(runner.device_holders())  # so the first sleep is like every later one
            log.info(
                "weights compacted into one allocation through the sleep host buffer",
                rank=spec.rank,
                bytes=self.sleep.weight_bytes,
                seconds=round(time.perf_counter() - started, 3),
            )
        # LoRA adapters of a diffusers transformer (lora_dir's at start), after the sleep controller
        # has named the base weights by their checkpoint keys (peft renames the layers it wraps).
        self.adapters = adapters.for_runner(runner, settings, device, spec.rank)
        self.spec = spec
        self.runner = runner
        self.device = device
        # compile, FP8 and step caching (models.acceleration); a bare runner gets the no-op one.
        self.acceleration = acceleration or Acceleration(None, settings, device)
        self.inbox = _Inbox(requests, self._answer_dropped)
        self.loads = BackgroundLoads(self.adapters, requests.put) if self.adapters is not None else None
        self.writer = ResultWriter(results)
        # A rank that is not its group's output rank runs every batch with it (same collectives,
        # same order); the output rank alone reports progress and outputs.
        self.packer = ipc.Packer(spec.parent_pid, spec.rank, pool_slots=ipc.WORKER_POOL_SLOTS)
        self.async_output = (
            AsyncOutputThread(device, self.packer, self.writer)
            if spec.output_rank and not settings.step_execution
            else None
        )
        # batch_invariant with a runner that cannot fix its batch shapes: one request at a time.
        self.items_alone = (
            settings.invariant_rows() > 0 and settings.kind in BATCHED_KINDS and not runner.batch_invariant
        )

    def serve(self) -> None:
        heartbeat = _Heartbeat(self.writer)
        try:
            self._serve()
        finally:
            heartbeat.stop()
            self.close()

    def close(self) -> None:
        try:
            if self.async_output is not None:
                self.async_output.drain()
                self.async_output.close()
        finally:
            # The host memory sleep holds (the level-1 buffer, the locked checkpoint) is
            # given back however serving ended.
            self.sleep.close()

    def _serve(self) -> None:
        while True:
            msg = self.inbox.next()
            if isinstance(msg, protocol.Shutdown):
                break
            if isinstance(msg, protocol.Execute):
                self.execute(msg)
            elif isinstance(msg, protocol.Control):
                self.control(msg)
            # A Cancel for a batch that already finished needs no answer.

    def execute(self, msg: protocol.Execute) -> None:
        def progress(step: int, total: int) -> None:
            if self.inbox.cancelled(msg.rpc_id):
                raise _CancelledByCaller()
            self.writer.put(protocol.Progress(msg.rpc_id, step, total))

        if self.sleep.level:
            self.writer.put(protocol.Failure(msg.rpc_id, f"asleep at level {self.sleep.level}"))
            return
        try:
            started_ns = time.time_ns()  # two clock reads a batch: the stage's spans of it, when traced
            items = [dataclasses.replace(item, inputs=ipc.unpack(item.inputs)) for item in msg.items]
            started = platform.DeviceEvent(self.device, timing=True).record()
            on_step = progress if self.spec.output_rank else None
            run = functools.partial(self.acceleration.run, self.runner.run)  # one step-cache count per run
            if self.adapters is not None:  # a batch shares its adapter set (the batch key)
                self.adapters.apply(items[0].params.adapters)
            if self.items_alone:
                outputs = run_items_alone(run, items, on_step)
            else:
                outputs = run(items, on_step)
            if not self.spec.output_rank:
                return
            if len(outputs) == len(items):  # images and videos to encode leave as uint8 pixels
                outputs = [tensors.encoded_form(o, i.params.output_format) for o, i in zip(outputs, items, strict=True)]
            finished = platform.DeviceEvent(self.device, timing=True).record()
            timing = protocol.BatchTiming(started_ns, time.time_ns(), self.spec.rank, os.getpid())
            if self.async_output is None:
                # One pack call: if any output fails to pack, the segments of the others are unlinked.
                payload = self.packer.pack(list(outputs))
                self.writer.put(
                    protocol.Result(msg.rpc_id, payload, self.stats(), finished.seconds_since(started), timing)
                )
                return
            output_id = new_output_id()
            self.writer.put(protocol.ComputeDone(msg.rpc_id, output_id, self.stats(), timing))
            self.async_output.submit(output_id, outputs, finished, started)
        except _CancelledByCaller:
            self.writer.put(protocol.Failure(msg.rpc_id, "cancelled by the caller", cancelled=True))
        except ItemError as exc:  # one request's fault: the stage runs the others again without it
            self.writer.put(protocol.Failure(msg.rpc_id, str(exc), item=exc.index))
        except Exception as exc:
            log.exception("batch failed", rpc_id=msg.rpc_id)  # one JSON line, with the stack
            self.writer.put(protocol.Failure(msg.rpc_id, f"{type(exc).__name__}: {exc}"))
            if self.spec.tp_group is not None or self.spec.image_group is not None:
                # The other ranks may wait in a collective this rank never reaches: end the
                # process so the stage restarts the group instead of running out of lockstep.
                self.writer.close()
                os._exit(1)

    def _answer_dropped(self, msg: protocol.Execute) -> None:
        for item in msg.items:
            ipc.discard(item.inputs)  # its input segments were packed for this rank alone
        self.writer.put(protocol.Failure(msg.rpc_id, "cancelled by the caller", cancelled=True))

    def control(self, msg: protocol.Control) -> None:
        """Control calls answer with an Ack straight away; they never go through the output path.
        An adapter load answers once a thread has read it and this loop has added it."""
        if msg.op == "adapter_load" and self.loads is not None:
            self.loads.start(msg)
            return
        try:
            result = self._control_ops()[msg.op](**msg.args)
            self.writer.put(protocol.Ack(msg.rpc_id, result=result, stats=self.stats()))
        except KeyError:
            self.writer.put(protocol.Ack(msg.rpc_id, error=f"unknown control operation {msg.op!r}"))
        except Exception as exc:
            log.exception("control call failed", op=msg.op)
            self.writer.put(protocol.Ack(msg.rpc_id, error=f"{type(exc).__name__}: {exc}"))

    def stats(self) -> protocol.WorkerStats:
        # Cheap: an allocator counter and an int; sent with every reply that ends a batch or a control call.
        skipped, passes = self.acceleration.step_cache_counts()
        return protocol.WorkerStats(
            platform.memory_allocated(self.device), self.runner.offload_bytes(), skipped, passes
        )

    def _control_ops(self) -> dict[str, Any]:
        ops = {"ping": self._ping, "drain": self._drain, "sleep": self._sleep, "wake": self._wake}
        if self.adapters is not None:
            ops.update(adapters.control_ops(self.adapters, self.loads.attach if self.loads else None))
        return ops

    def _ping(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rank": self.spec.rank,
            "device_memory_bytes": platform.memory_allocated(self.device),
            "sleep_level": self.sleep.level,
        }
        dlo = self.runner.dlo_stats()
        if dlo is not None:
            out["dlo"] = dlo
        if self.acceleration.compiled:
            out["compile"] = self.acceleration.compile_stats()
        return out

    def _sleep(self, level: int) -> dict[str, Any]:
        refusal = self.runner.sleep_refusal(level) or self.acceleration.sleep_refusal(level)
        if refusal is not None:
            raise RuntimeError(refusal)
        # Outputs still being copied reference device memory: they must be out before it is freed.
        drained = self._drain()["drained"]
        if not drained:
            raise RuntimeError("async outputs still in flight after 10 s; not sleeping")
        # DLO: the runner's offload engine frees its device slots within the same measurement.
        adapters = [self.adapters.for_sleep(level)] if self.adapters is not None else []
        holders = [*self.runner.device_holders(), *adapters]
        result = self.sleep.sleep(level, holders=holders)
        return {"level": result.level, "freed_bytes": result.freed_bytes, "latency_ms": result.latency_ms}

    def _wake(self) -> dict[str, Any]:
        result = self.sleep.wake()
        return {"level": result.level, "freed_bytes": result.freed_bytes, "latency_ms": result.latency_ms}

    def _drain(self, timeout_s: float | None = None) -> dict[str, Any]:
        if self.async_output is None:
            return {"drained": True}
        return {"drained": self.async_output.drain(timeout_s if timeout_s is not None else 10.0)}


def run(spec: protocol.WorkerSpec, requests, results, ahead: ReadAhead | None = None) -> None:
    """The worker's life after its light start (worker/entry.py): load, warm up, say Ready,
    serve. `ahead`: the read-ahead of its checkpoint, running; stopped once the load is over."""
    settings = spec.settings
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    model_dir = resolved_model_dir(settings)
    device = resolve_device(settings.device, spec.rank)
    try:
        with startup.phase("process groups"):
            group = _join_dp_group(spec, device)
            tp = _join_tp_group(spec, device)
            parallel = _join_image_group(spec, device)
        if diffusers_adapter.is_diffusers_folder(model_dir):
            with startup.phase("model imports"):
                diffusers_adapter.import_for(model_dir, settings.kind)
        if ahead is not None:
            ahead.raise_if_failed()
        with startup.phase("model load", kind=settings.kind, device=device):
            runner = build_runner(
                settings.kind,
                model_dir,
                device,
                dlo=DloOptions.from_settings(settings),
                group=group,
                tp=tp,
                cuda_graphs=settings.cuda_graphs,
                invariant_rows=settings.invariant_rows(),
                parallel=parallel,
            )
            if ahead is not None:
                ahead.stop()  # all read by now: its phase goes out with Ready
        with startup.phase("acceleration"):
            accel = acceleration.prepare(runner, settings, device)
        with startup.phase("sleep and output set-up"):
            worker = Worker(spec, runner, device, requests, results, accel)
    except Exception as exc:
        if not _says_it_all(exc):
            log.exception("model load failed")  # a bug: its stack is what the log needs
        results.put(protocol.LoadFailed(spec.rank, f"{type(exc).__name__}: {exc}"))
        return
    try:
        # After the set-up: what the first request meets (compacted weights, captured graphs)
        # is what the warm-up prepares.
        warm_up(runner, settings, device, run=lambda items: accel.run(runner.run, items))
    except WarmUpFailed as exc:
        log.error("warm-up failed", reason=str(exc))
        worker.close()
        results.put(protocol.LoadFailed(spec.rank, str(exc)))
        return
    # Ready once the worker can serve: its heartbeats start with serve(), right after.
    worker.writer.put(
        protocol.Ready(
            spec.rank,
            {**runner.limits(), **accel.limits()},
            device,
            platform.memory_allocated(device),
            input_specs=runner.input_specs(),
            supports_negative_prompt=runner.supports_negative_prompt,
            supports_init_image=runner.supports_init_image,
            phases=tuple(startup.records()),
            adapters=tuple(worker.adapters.names()) if worker.adapters is not None else None,
        )
    )
    worker.serve()
    if group is not None or tp is not None or parallel is not None:
        from stagemesh.stage_service.offload.collective import leave_group

        leave_group()


def _says_it_all(exc: Exception) -> bool:
    """A bad file or option (checkpoint and folder errors are ValueErrors) is explained by its
    message, which the stage logs; a stack would only bury it."""
    from safetensors import SafetensorError

    return isinstance(exc, (OSError, ValueError, SafetensorError))


def _join_dp_group(spec: protocol.WorkerSpec, device: str):
    """Before loading: with DLO AllGather each rank keeps only its shard of the weights, so
    the group must exist when the model is packed."""
    if spec.dp_group is None:
        return None
    from stagemesh.stage_service.offload.collective import join_group

    g = spec.dp_group
    return join_group(g.address, spec.rank, g.world_size, device, g.timeout_s)


def _join_tp_group(spec: protocol.WorkerSpec, device: str):
    """Before loading: each TP rank builds and loads only its shards of the DiT."""
    if spec.tp_group is None:
        return None
    from stagemesh.stage_service.models.tp import TpGroup
    from stagemesh.stage_service.offload.collective import join_group

    g = spec.tp_group
    group = join_group(g.address, spec.rank, g.world_size, device, g.timeout_s)
    return TpGroup(g.world_size, spec.rank, group)


def _join_image_group(spec: protocol.WorkerSpec, device: str):
    """Before loading: the ranks that split each image (sequence / CFG parallel) share one group,
    and with both kinds of split, one sub-group per pass and per sequence slice."""
    if spec.image_group is None:
        return None
    from stagemesh.stage_service.models.parallel import form_axes
    from stagemesh.stage_service.offload.collective import join_group

    g = spec.image_group
    world = join_group(g.address, spec.rank, g.world_size, device, g.timeout_s)
    cfg_size = 2 if spec.settings.cfg_parallel else 1
    return form_axes(spec.settings.sp_size, cfg_size, spec.rank, world)

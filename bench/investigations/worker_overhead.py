"""Where the serving worker's forward pass loses speed: the worker's own code, in one process.

bench/async_output.py shows the forward rate inside the serving worker (d) below the bare
forward rate (a) when the model is launch-bound (a small DiT at small sizes: the host launches
kernels slower than the GPU runs them, so any host work or lock wait on the launching thread
costs throughput). This benchmark runs back-to-back batches through pieces of the worker, each
adding one thing, and reports requests/s (device synchronized, async outputs drained):

  forward              runner.run, conditioning already on the device (the (a) limit)
  + host inputs        the conditioning arrives on the host, as it does from the executor
  + progress           the worker's per-step callback: cancel check and Progress message
  worker, step mode    Worker.execute, synchronous output (copy and pack on the main thread)
  worker, async        Worker.execute with the async output thread (the default)
  ..., spinning wait   the same, its output thread waiting for the copies by spinning on the
                       stream (as before it slept on a blocking event)
  ..., no pack         its output thread copies to the host but sends no payload
  ..., no copy         its output thread only waits for the forward pass
  ..., queue, per item the output path before commits ce58483 and 46b4572: results through a
                       multiprocessing.Queue (a feeder thread writes them), one device-to-host
                       copy per request instead of one per batch
  forward, N busy      the bare forward while N other processes spin on other cores: whether
                       busy cores elsewhere (the serving stack's) slow the launching thread

Messages go to the worker's real result pipe (or a multiprocessing queue) that another process
drains. The host's launch speed drifts by tens of percent between measurements minutes apart,
so the variants run in short interleaved rounds and each is reported as the median over rounds of its rate over the
bare forward rate of the same round. Run on a GPU: python -m bench.investigations.worker_overhead
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_output, add_repeats, print_table, write_json
from stagemesh.core.params import Params
from stagemesh.stage_service import platform
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.runners import DiffusionRunner, WorkItem
from stagemesh.stage_service.models.weights import ensure_model_dir
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.transport import ipc, protocol
from stagemesh.stage_service.transport.result_pipe import result_pipe
from stagemesh.stage_service.worker import async_output
from stagemesh.stage_service.worker.async_output import AsyncOutputThread, copy_to_host
from stagemesh.stage_service.worker.process import Worker

BUSY_PROCESSES = 3  # the serving stack's busy threads outside the worker, roughly


class NoPayload:
    """A packer that packs nothing: the output thread still copies to the host and waits."""

    def pack(self, obj):
        return None


def copy_only_output_thread(device, packer, writer) -> AsyncOutputThread:
    return AsyncOutputThread(device, NoPayload(), writer)


class WaitOnlyOutputThread(AsyncOutputThread):
    """Only waits for the forward pass: no copy, no pack."""

    def _host_payload(self, outputs, event):
        event.synchronize()
        return None


class PerItemCopyOutputThread(AsyncOutputThread):
    """Copies each output tensor on its own, as before a batch's storage came over at once."""

    def _host_payload(self, outputs, event):
        with self._stream.active():
            self._stream.wait_event(event)
            host = async_output._copy(outputs, {})  # no whole storages: one copy per tensor
            copied = platform.DeviceEvent(self._stream.device, blocking=True).record(self._stream)
        copied.synchronize()
        return self._packer.pack(host)


def _spin(go, stop) -> None:
    """Busy-loop while `go` is set, until `stop`."""
    while not stop.is_set():
        if go.wait(0.05):
            while go.is_set():
                sum(range(1000))


class SpinningOutputThread(AsyncOutputThread):
    """The output thread as it was: waits for its copies with a (spinning) stream sync."""

    def _host_payload(self, outputs, event):
        with self._stream.active():
            self._stream.wait_event(event)
            host = copy_to_host(outputs, self._stream)
        self._stream.synchronize()
        return self._packer.pack(host)


def _drain(results) -> None:
    """Consumer process: read and drop every message until None (segments are unlinked)."""
    while (msg := results.get()) is not None:
        payload = getattr(msg, "payload", None)
        if payload is not None:
            ipc.unpack(payload)


def _busy(fn):
    """Mark a variant to run while the spinning processes are busy."""
    fn.busy = True
    return fn


def _items(batch: int, size: int, steps: int, device: str) -> list[WorkItem]:
    g = torch.Generator().manual_seed(0)
    return [
        WorkItem(
            f"r{i}",
            Params("p", size, size, steps, 4.0, i, "tensor"),
            {"hidden_states": torch.randn(12, 64, generator=g).to(device)},
        )
        for i in range(batch)
    ]


def _spec(model_dir: Path, device: str, step_execution: bool = False) -> protocol.WorkerSpec:
    settings = StageSettings(
        stage_id=1,
        kind="diffusion",
        model_dir=str(model_dir),
        device=device,
        step_execution=step_execution,
        batch_invariant=False,
    )
    return protocol.WorkerSpec(settings, rank=0, parent_pid=os.getpid())


class Pieces:
    """The worker's pieces around one runner, fed and drained through real queues."""

    # mode -> the output thread a worker of that mode gets (device, packer, writer)
    OUTPUT_THREADS = {"spin": SpinningOutputThread, "copy": copy_only_output_thread, "wait": WaitOnlyOutputThread}

    def __init__(self, model_dir: Path, device: str):
        ctx = mp.get_context("spawn")
        self.requests = ctx.Queue()
        receiver, self.results = result_pipe(ctx)  # the worker's own result channel
        self.consumer = ctx.Process(target=_drain, args=(receiver,), daemon=True)
        self.consumer.start()
        receiver.close()
        self.device = device
        self.runner = DiffusionRunner(model_dir, device)
        self.workers = {
            mode: Worker(
                _spec(model_dir, device, step_execution=mode == "step"),
                self.runner,
                device,
                self.requests,
                self.results,
            )
            for mode in ("step", "async", *self.OUTPUT_THREADS)
        }
        for mode, thread in self.OUTPUT_THREADS.items():
            worker = self.workers[mode]
            worker.async_output.close()
            worker.async_output = thread(device, worker.packer, worker.writer)
        # The output path as it was: a multiprocessing.Queue and one copy per request.
        self.old_results = ctx.Queue()
        self.old_consumer = ctx.Process(target=_drain, args=(self.old_results,), daemon=True)
        self.old_consumer.start()
        old = Worker(
            _spec(model_dir, device),
            self.runner,
            device,
            self.requests,
            self.old_results,
        )
        old.async_output.close()
        old.async_output = PerItemCopyOutputThread(device, old.packer, old.writer)
        self.workers["before"] = old
        self.spin_go, self.spin_stop = ctx.Event(), ctx.Event()
        self.spinners = [
            ctx.Process(target=_spin, args=(self.spin_go, self.spin_stop), daemon=True) for _ in range(BUSY_PROCESSES)
        ]
        for p in self.spinners:
            p.start()

    def close(self) -> None:
        for worker in self.workers.values():
            if worker.async_output is not None:
                worker.async_output.close()
            worker.packer.close()
        self.results.put(None)
        self.consumer.join(30)
        self.old_results.put(None)
        self.old_consumer.join(30)
        self.spin_stop.set()
        for p in self.spinners:
            p.join(30)
        ipc.sweep(os.getpid())

    def variants(self, batch: int, size: int, steps: int) -> dict:
        on_device = _items(batch, size, steps, self.device)
        on_host = _items(batch, size, steps, "cpu")
        worker = self.workers["async"]

        def progress(step: int, total: int) -> None:  # what Worker.execute's callback does
            worker.inbox.cancelled("rpc")
            worker.writer.put(protocol.Progress("rpc", step, total))

        def execute(mode: str):
            msg = protocol.Execute("rpc", [{**vars(i), "inputs": ipc.pack(i.inputs)} for i in on_host])
            return lambda: self.workers[mode].execute(msg)

        return {
            "forward": lambda: self.runner.run(on_device),
            "+ host inputs": lambda: self.runner.run(on_host),
            "+ progress": lambda: self.runner.run(on_host, progress),
            "worker, step mode": execute("step"),
            "worker, async": execute("async"),
            "worker, async, spinning wait": execute("spin"),
            "worker, async, copy but no pack": execute("copy"),
            "worker, async, no copy, no pack": execute("wait"),
            "worker, async, queue, per item (before)": execute("before"),
            f"forward, {BUSY_PROCESSES} busy": _busy(lambda: self.runner.run(on_device)),
        }

    def rate(self, fn, batch: int, iters: int) -> float:
        if getattr(fn, "busy", False):
            self.spin_go.set()
        try:
            for _ in range(3):
                fn()
            self._settle()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            self._settle()
            return batch * iters / (time.perf_counter() - start)
        finally:
            self.spin_go.clear()

    def _settle(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        for worker in self.workers.values():
            if worker.async_output is not None:
                worker.async_output.drain()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--iters", type=int, default=12, help="batches per variant and repeat")
    add_repeats(parser, 7, "interleaved passes over the variants (default: 7)", "--rounds")
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval for this process (default: Python's 5 ms)",
    )
    add_output(parser, "worker_overhead")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)

    model_dir = ensure_model_dir(Path(tempfile.mkdtemp()) / "tiny", PipelineConfig.tiny())
    pieces = Pieces(model_dir, args.device)
    points, rows = [], []
    try:
        for size in args.sizes:
            for batch in args.batches:
                variants = pieces.variants(batch, size, args.steps)
                for fn in variants.values():  # first use of each path (allocations, pools)
                    pieces.rate(fn, batch, 2)
                rates: dict[str, list[float]] = {name: [] for name in variants}
                for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
                    for name, fn in variants.items():
                        rates[name].append(pieces.rate(fn, batch, args.iters))
                for name, values in rates.items():
                    ratios = [v / f for v, f in zip(values, rates["forward"])]
                    point = {
                        "size": size,
                        "batch": batch,
                        "variant": name,
                        "rps_median": statistics.median(values),
                        "over_forward_median": statistics.median(ratios),
                        "over_forward_min": min(ratios),
                        "over_forward_max": max(ratios),
                        "rps": values,
                    }
                    points.append(point)
                    rows.append(
                        [size, batch, name, point["rps_median"], point["over_forward_median"], min(ratios), max(ratios)]
                    )
                print(f"size {size} batch {batch} done", flush=True)
    finally:
        pieces.close()
    print_table(["size", "batch", "variant", "median req/s", "x forward (median)", "min", "max"], rows, floatfmt=".3f")
    path = write_json(
        args.output,
        "worker_overhead",
        {
            "device": args.device,
            "steps": args.steps,
            "iters": args.iters,
            "switch_interval_s": sys.getswitchinterval(),
            "points": points,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""A worker on real queues for the async-output and worker tests: a tiny real runner (no mock
library), a packer that can be held, the real output thread observed, and a Worker serving real
multiprocessing queues on a thread of the test process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import threading
from pathlib import Path

import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.contract import RunnerBase, WorkItem
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.transport import ipc, protocol
from stagemesh.stage_service.transport.result_pipe import result_pipe
from stagemesh.stage_service.worker import async_output
from stagemesh.stage_service.worker.async_output import AsyncOutputThread
from stagemesh.stage_service.worker.process import Worker

HEX32 = re.compile(r"^[0-9a-f]{32}$")
CTX = mp.get_context("spawn")
WAIT_S = 10.0


class StubRunner(RunnerBase):
    """Each item becomes {"image": a tensor filled with its seed} of `numel` float32 values."""

    def __init__(self, numel: int = 6, fail_on_seed: int | None = None):
        self.numel = numel
        self.fail_on_seed = fail_on_seed
        self.log: list[str] | None = None
        self.net = torch.nn.Linear(8, 8)  # a few real weights, for sleep

    def weight_files(self):
        from stagemesh.stage_service.models.contract import WeightFile

        return [WeightFile(Path("/nonexistent/stub.safetensors"), {"": self.net})]

    def run(self, items, progress):
        out = []
        for i, item in enumerate(items):
            if item.params.seed == self.fail_on_seed:
                raise ValueError(f"seed {item.params.seed} is cursed")
            out.append({"image": torch.full((self.numel,), float(item.params.seed)), "seed": item.params.seed})
            progress(i + 1, len(items))
        if self.log is not None:
            self.log.append(f"forward@{threading.current_thread().name}")
        return out

    def limits(self):
        return {}


class GatedPacker:
    """Wraps the real packer; pack() blocks until `release` is set (so an output stays in flight)."""

    def __init__(self, fail: bool = False):
        self.inner = ipc.Packer(os.getpid(), 0)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = fail
        self.calls = 0

    def pack(self, obj):
        self.calls += 1
        self.entered.set()
        assert self.release.wait(WAIT_S), "test never released the packer"
        if self.fail:
            raise RuntimeError("packing exploded")
        return self.inner.pack(obj)


class ObservedOutputThread(AsyncOutputThread):
    """The real thread; tells the test when someone starts to drain it."""

    def __init__(self, *args, **kwargs):
        self.draining = threading.Event()
        super().__init__(*args, **kwargs)

    def drain(self, timeout_s: float = async_output.DRAIN_TIMEOUT_S) -> bool:
        self.draining.set()
        return super().drain(timeout_s)


def item(seed: int) -> WorkItem:
    return WorkItem(f"req-{seed}", Params("p", 16, 16, 1, 1.0, seed, "tensor"))


class Harness:
    """A real Worker serving real multiprocessing queues on a thread of this process."""

    def __init__(self, runner=None, packer=None, own_packer: bool = False, **options):
        """`options`: stage settings (step_execution, batch_invariant, ...) the worker reads."""
        self.requests = CTX.Queue()
        self.results, self.sender = result_pipe(CTX)
        settings = StageSettings(**{"stage_id": 1, "kind": "diffusion", "batch_invariant": False, **options})
        spec = protocol.WorkerSpec(settings, rank=0, parent_pid=os.getpid())
        self.runner = runner or StubRunner()
        self.worker = Worker(spec, self.runner, "cpu", self.requests, self.sender)
        self.packer = packer
        if not own_packer:
            # A plain packer (one-shot segments, no reusable slot pool), so that every segment
            # must be gone once its reader unpacked it; the pooled default has its own test.
            self.worker.packer = ipc.Packer(os.getpid(), 0)
        if not settings.step_execution and (packer is not None or not own_packer):
            self.worker.async_output.close()
            self.worker.async_output = ObservedOutputThread("cpu", packer or self.worker.packer, self.worker.writer)
        self.thread = threading.Thread(target=self.worker.serve, name="worker-main", daemon=True)
        self.thread.start()

    def send(self, msg) -> None:
        self.requests.put(msg)

    def next(self, timeout: float = WAIT_S):
        return self.results.get(timeout=timeout)

    def next_of(self, kind, timeout: float = WAIT_S):
        """Skip Progress messages."""
        while True:
            msg = self.next(timeout)
            if not isinstance(msg, protocol.Progress):
                assert isinstance(msg, kind), msg
                return msg

    def stop(self) -> None:
        if self.packer is not None:
            self.packer.release.set()
        self.send(protocol.Shutdown())
        self.thread.join(WAIT_S + 5)
        assert not self.thread.is_alive()
        leftovers = []
        while True:
            try:
                leftovers.append(self.results.get(timeout=0.05))
            except queue.Empty:
                break
        for msg in leftovers:  # unread outputs still own segments: read them as the executor would
            if isinstance(msg, protocol.OutputReady) and msg.payload is not None:
                ipc.unpack(msg.payload)
            if isinstance(msg, protocol.Result):
                ipc.unpack(msg.outputs)
        self.requests.close()
        self.requests.join_thread()
        self.sender.close()
        self.results.close()

"""One stage served in this process as a stage service serves it (engine -> executor -> worker
process) and the bare forward pass it is measured against: the embedded (tiny) DiT, fed with
random conditioning, for bench/async_output.py and the investigations that time the same paths."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path

import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.engine.dispatch import Engine, OutputsEvent
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models.runners import DiffusionRunner, WorkItem
from stagemesh.stage_service.settings import StageSettings


def _cond(seed: int) -> torch.Tensor:
    return torch.randn(12, 64, generator=torch.Generator().manual_seed(seed))


def _params(size: int, steps: int, seed: int) -> Params:
    return Params(
        prompt="p",
        width=size,
        height=size,
        num_inference_steps=steps,
        guidance_scale=4.0,
        seed=seed,
        output_format="tensor",
    )


class Forward:
    """bench/async_output.py's (a): runner.run alone in this process, conditioning on the device,
    synchronized each time."""

    def __init__(self, model_dir: Path, device: str, size: int, batch: int, steps: int, cuda_graphs: bool = True):
        self.runner = DiffusionRunner(model_dir, device, cuda_graphs=cuda_graphs)
        self.items = [
            WorkItem(f"r{i}", Params("p", size, size, steps, 4.0, i, "tensor"), {"hidden_states": _cond(i).to(device)})
            for i in range(batch)
        ]
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.rate(3)  # warm-up

    def rate(self, iters: int) -> tuple[float, float]:
        """(sustained requests/s over all `iters` passes, requests/s at the median pass). The
        served paths run every pass, slow ones included, so the sustained rate is their limit;
        the median one shows how far host hiccups (slow passes) pull it down."""
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            self.runner.run(self.items)
            self.sync()
            times.append(time.perf_counter() - start)
        return len(self.items) * iters / sum(times), len(self.items) / statistics.median(times)

    def pipelined_rate(self, iters: int) -> float:
        """(e): requests/s over `iters` passes issued back to back, synchronized once."""
        self.sync()
        start = time.perf_counter()
        for _ in range(iters):
            self.runner.run(self.items)
        self.sync()
        return len(self.items) * iters / (time.perf_counter() - start)


class Served:
    """bench/async_output.py's (b) or (c): engine -> executor -> worker process, kept up across rounds."""

    def __init__(
        self,
        model_dir: Path,
        device: str,
        size: int,
        batch: int,
        steps: int,
        step_execution: bool,
        cuda_graphs: bool = True,
        concurrency: int = 0,
    ):
        self.size, self.steps = size, steps
        settings = StageSettings(
            stage_id=1,
            kind="diffusion",
            model_dir=str(model_dir),
            device=device,
            step_execution=step_execution,
            cuda_graphs=cuda_graphs,
            # batch_invariant runs every pass at max_batch_size requests: this point's batch.
            max_batch_size=batch,
        )
        self.executor = Executor(settings)
        self.executor.start()
        self.engine = Engine(self.executor, "diffusion", max_batch_size=batch, max_queue=10_000)
        # Enough requests in flight that full batches are always waiting (a saturated stage). With
        # captured steps the worker launches several batches ahead of the GPU, and a request is
        # in flight until its output is back: the engine's next batch, the worker's queue, the
        # GPU's queue and the output path all hold requests. At 4 x batch (16 at batch 4) the
        # next batch was missing when the worker looked for it in 58 % of passes.
        self.concurrency = concurrency or max(32, 16 * batch)
        self.seed = 0

    async def start(self) -> None:
        self.engine.start()
        await self._requests(self.concurrency)  # warm-up

    async def rate(self, requests: int) -> tuple[float, float]:
        """(requests/s, requests / the worker's forward-pass device seconds) over `requests`."""
        # Every output of earlier requests is back, so their forward passes are counted already.
        compute_before, start = self.executor.compute_seconds, time.perf_counter()
        await self._requests(requests)
        seconds = time.perf_counter() - start
        return requests / seconds, requests / (self.executor.compute_seconds - compute_before)

    async def _requests(self, count: int) -> None:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(seed: int) -> None:
            async with sem:
                params = _params(self.size, self.steps, seed)
                async for event in self.engine.run(f"r{seed}", params, {"hidden_states": _cond(seed)}):
                    if isinstance(event, OutputsEvent):
                        assert event.outputs["image"].shape == (self.size, self.size, 3)

        seeds = range(self.seed, self.seed + count)
        self.seed += count
        await asyncio.gather(*(one(s) for s in seeds))

    async def close(self) -> None:
        try:
            await self.engine.close()
        finally:
            self.executor.shutdown()


async def start_paths(up: contextlib.AsyncExitStack, model_dir: Path, args, size: int, batch: int) -> list[Served]:
    """(b) the synchronous and (c) the async path of one point, started; `up` closes each
    one started, also on failure."""
    paths = []
    for step_execution in (True, False):
        path = Served(
            model_dir, args.device, size, batch, args.steps, step_execution, args.cuda_graphs, args.concurrency
        )
        up.push_async_callback(path.close)
        await path.start()
        paths.append(path)
    return paths


def add_serving_args(parser: argparse.ArgumentParser, sizes: list[int], batches: list[int]) -> None:
    """The options of a served point (start_paths reads them)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=sizes)
    parser.add_argument("--batches", type=int, nargs="+", default=batches)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--concurrency", type=int, default=0, help="requests in flight per served path (default: max(32, 16 x batch))"
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="denoising steps from captured CUDA graphs (the stage default)",
    )


def serving_options(args: argparse.Namespace) -> dict:
    """The options of add_serving_args a run's JSON records (with the requests per round)."""
    return {
        "device": args.device,
        "rounds": args.repeats,
        "requests": args.requests,
        "concurrency": args.concurrency or "max(32, 16 x batch)",
        "cuda_graphs": args.cuda_graphs,
    }

"""Async output vs the synchronous path, against the forward-only limit.

For the default (tiny) DiT at several resolutions and batch sizes, in one run:
  (a) forward-only rate: requests/s of runner.run alone, in this process, device-synchronized,
      sustained over as many forward passes as (b) and (c) run per round (slow passes count,
      as they do when serving; the rate at the median pass is reported beside it);
  (b) QPS through engine + executor + worker process with step_execution (synchronous output);
  (c) QPS through the same path with async output (the default);
  (d) the forward rate inside the serving worker during (c): requests / the device time of its
      forward passes (stagemesh_stage_compute_seconds). (d) below (a) means the forward pass
      itself slows down while serving; (c) below (d) means the device idles between batches.
  (e) pipelined forward rate: the passes of (a) issued back to back with one synchronization at
      the end, so the host prepares each pass while the device runs the last: the device's own
      rate, the floor a served pass cannot beat. (a) pays each pass's host preparation with the
      device idle (its synchronization empties the queue), which overlapping hides when serving.
Eager, the small DiT is launch-bound (the host issues kernels slower than the GPU runs them), and
the GPU host's launch speed drifts by tens of percent between measurements minutes apart. So both
paths stay up for the whole point and (a)-(e) run in short interleaved rounds; figures are
medians over rounds and each ratio the median of the rounds' own ratios.
Target: (c) >= 0.97 x (a) at every point. Run on a GPU: python bench/async_output.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json
from stagemesh.core.params import Params
from stagemesh.stage_service.engine.dispatch import Engine, OutputsEvent
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.runners import DiffusionRunner, WorkItem
from stagemesh.stage_service.models.weights import ensure_model_dir
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
    """(a): runner.run alone in this process, conditioning on the device, synchronized each time."""

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
    """(b) or (c): engine -> executor -> worker process, kept up across rounds."""

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


async def measure_point(model_dir: Path, args, size: int, batch: int) -> dict:
    """Rounds of (a)-(e) in turn; each figure is the median over rounds, each ratio the
    median of the rounds' own ratios (the host's launch speed drifts between rounds)."""
    forward = Forward(model_dir, args.device, size, batch, args.steps, args.cuda_graphs)
    rounds = []
    async with contextlib.AsyncExitStack() as up:
        sync, served = await start_paths(up, model_dir, args, size, batch)
        # (a) runs as many forward passes as (b) and (c) do per round: windows of one length.
        iters = args.iters or max(1, args.requests // batch)
        for _ in range(args.rounds):
            a, a_median = forward.rate(iters)
            e = forward.pipelined_rate(iters)
            b, _ = await sync.rate(args.requests)
            c, d = await served.rate(args.requests)
            rounds.append({"a": a, "b": b, "c": c, "d": d, "e": e, "a_median_pass": a_median})
    med = {k: statistics.median(r[k] for r in rounds) for k in ("a", "b", "c", "d", "e", "a_median_pass")}
    ratio = {
        f"{x}/{y}": statistics.median(r[x] / r[y] for r in rounds)
        for x, y in (("c", "a"), ("c", "d"), ("d", "a"), ("c", "b"), ("c", "e"), ("c", "a_median_pass"))
    }
    spread = (max(r["a"] for r in rounds) - min(r["a"] for r in rounds)) / med["a"]
    return dict(
        size=size,
        batch=batch,
        steps=args.steps,
        forward_rps=med["a"],
        sync_qps=med["b"],
        async_qps=med["c"],
        worker_forward_rps=med["d"],
        async_over_forward=ratio["c/a"],
        async_over_worker_forward=ratio["c/d"],
        worker_forward_over_forward=ratio["d/a"],
        async_over_sync=ratio["c/b"],
        pipelined_forward_rps=med["e"],
        async_over_pipelined=ratio["c/e"],
        forward_median_pass_rps=med["a_median_pass"],
        async_over_median_pass=ratio["c/a_median_pass"],
        forward_spread=spread,
        rounds=rounds,
    )


def add_serving_args(parser: argparse.ArgumentParser, sizes: list[int], batches: list[int]) -> None:
    """The options of a served point, shared with bench/investigations/async_timeline.py (start_paths reads them)."""
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
        "rounds": args.rounds,
        "requests": args.requests,
        "concurrency": args.concurrency or "max(32, 16 x batch)",
        "cuda_graphs": args.cuda_graphs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_serving_args(parser, sizes=[256, 512, 1024], batches=[1, 4])
    parser.add_argument(
        "--iters", type=int, default=0, help="(a): forward passes per round (default: as many as (b) and (c) run)"
    )
    parser.add_argument(
        "--requests", type=int, default=192, help="(b), (c): requests per round (several times the requests in flight)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default="bench/results/async_output.json")
    args = parser.parse_args()

    model_dir = ensure_model_dir(Path(tempfile.mkdtemp()) / "tiny", PipelineConfig.tiny())
    rows, points = [], []
    for size in args.sizes:
        for batch in args.batches:
            p = asyncio.run(measure_point(model_dir, args, size, batch))
            points.append(p)
            rows.append(
                [
                    size,
                    batch,
                    p["forward_rps"],
                    p["forward_spread"] * 100,
                    p["sync_qps"],
                    p["async_qps"],
                    p["worker_forward_rps"],
                    p["async_over_forward"],
                    p["async_over_worker_forward"],
                    (p["async_over_sync"] - 1) * 100,
                    p["pipelined_forward_rps"],
                    p["async_over_pipelined"],
                ]
            )
            print(
                f"size {size} batch {batch}: forward {p['forward_rps']:.1f}/s, sync "
                f"{p['sync_qps']:.1f}/s, async {p['async_qps']:.1f}/s (worker forward "
                f"{p['worker_forward_rps']:.1f}/s)",
                flush=True,
            )
    print_table(
        [
            "size",
            "batch",
            "(a) forward req/s",
            "(a) spread %",
            "(b) sync QPS",
            "(c) async QPS",
            "(d) worker fwd req/s",
            "(c)/(a)",
            "(c)/(d)",
            "(c)/(b) gain %",
            "(e) pipelined fwd req/s",
            "(c)/(e)",
        ],
        rows,
        floatfmt=".2f",
    )
    path = write_json(args.output, "async_output", {**serving_options(args), "points": points})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

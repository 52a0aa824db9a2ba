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
Target: (c) >= 0.97 x (a) at every point. Run on a GPU: python -m bench.async_output
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
from pathlib import Path

from bench.common import add_output, add_repeats, print_table, write_json
from bench.serving import Forward, add_serving_args, serving_options, start_paths
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.weights import ensure_model_dir


async def measure_point(model_dir: Path, args, size: int, batch: int) -> dict:
    """Rounds of (a)-(e) in turn; each figure is the median over rounds, each ratio the
    median of the rounds' own ratios (the host's launch speed drifts between rounds)."""
    forward = Forward(model_dir, args.device, size, batch, args.steps, args.cuda_graphs)
    rounds = []
    async with contextlib.AsyncExitStack() as up:
        sync, served = await start_paths(up, model_dir, args, size, batch)
        # (a) runs as many forward passes as (b) and (c) do per round: windows of one length.
        iters = args.iters or max(1, args.requests // batch)
        for _ in range(args.repeats):
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    add_serving_args(parser, sizes=[256, 512, 1024], batches=[1, 4])
    parser.add_argument(
        "--iters", type=int, default=0, help="(a): forward passes per round (default: as many as (b) and (c) run)"
    )
    parser.add_argument(
        "--requests", type=int, default=192, help="(b), (c): requests per round (several times the requests in flight)"
    )
    add_repeats(parser, 5, "rounds of (a)-(e); figures are medians over them (default: 5)", "--rounds")
    add_output(parser, "async_output")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

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

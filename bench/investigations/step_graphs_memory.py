"""What captured denoising steps cost: device memory per batch shape and the first batch's time.

The embedded DiT's runner serves batch shapes one after another, eagerly (`cuda_graphs` off) and
from captured graphs (on). After each shape's first batch (which captures its graph) and after a
second batch of it, the benchmark reads the caching allocator: bytes allocated (live tensors,
graph buffers and pools included) and reserved, and the peak of each batch. The graphs'
cost is the difference between the two runners after the same shapes; the first batch's
extra time is the capture (warm-up runs plus one recorded step). Random conditioning, seeds
per request. Run on a GPU: python -m bench.investigations.step_graphs_memory
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_output, print_table, write_json
from stagemesh.core.params import Params
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.runners import DiffusionRunner, WorkItem
from stagemesh.stage_service.models.weights import ensure_model_dir

MiB = 1 << 20


def _items(size: int, batch: int, steps: int, seed: int) -> list[WorkItem]:
    g = torch.Generator().manual_seed(seed)
    return [
        WorkItem(
            f"r{i}",
            Params("p", size, size, steps, 4.0, seed + i, "tensor"),
            {"hidden_states": torch.randn(12, 64, generator=g)},
        )
        for i in range(batch)
    ]


def _timed_batch(runner: DiffusionRunner, items: list[WorkItem]) -> tuple[float, int]:
    """(seconds, peak bytes allocated) of one synchronized batch."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = runner.run(items)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert all(torch.isfinite(o["image"]).all() for o in out)
    return seconds, torch.cuda.max_memory_allocated()


def serve_shapes(model_dir: Path, shapes: list[tuple[int, int]], steps: int, graphs: bool) -> list[dict]:
    runner = DiffusionRunner(model_dir, "cuda", cuda_graphs=graphs)
    base = torch.cuda.memory_allocated()
    rows = []
    for n, (size, batch) in enumerate(shapes):
        first, first_peak = _timed_batch(runner, _items(size, batch, steps, 100 * n))
        second, second_peak = _timed_batch(runner, _items(size, batch, steps, 100 * n + 50))
        rows.append(
            {
                "size": size,
                "batch": batch,
                "graphs": graphs,
                "first_s": first,
                "second_s": second,
                "peak_mib": max(first_peak, second_peak) / MiB,
                "allocated_mib": (torch.cuda.memory_allocated() - base) / MiB,
                "reserved_mib": torch.cuda.memory_reserved() / MiB,
            }
        )
    del runner
    torch.cuda.empty_cache()
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["256x1", "256x4", "512x4", "1024x4", "256x1"],
        help="SIZExBATCH in serving order (default: the four shapes a stage keeps "
        "graphs for, then the first again, which finds its graph kept)",
    )
    parser.add_argument("--steps", type=int, default=8)
    add_output(parser, "step_graphs_memory")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("step_graphs_memory needs a CUDA device (graphs are captured only there)")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    model_dir = ensure_model_dir(Path(tempfile.mkdtemp()) / "tiny", PipelineConfig.tiny())
    eager = serve_shapes(model_dir, shapes, args.steps, graphs=False)
    captured = serve_shapes(model_dir, shapes, args.steps, graphs=True)
    rows = []
    for e, c in zip(eager, captured):
        rows.append(
            [
                f"{c['size']}²",
                c["batch"],
                e["first_s"] * 1e3,
                c["first_s"] * 1e3,
                e["second_s"] * 1e3,
                c["second_s"] * 1e3,
                e["allocated_mib"],
                c["allocated_mib"],
                e["peak_mib"],
                c["peak_mib"],
                e["reserved_mib"],
                c["reserved_mib"],
            ]
        )
    print_table(
        [
            "shape",
            "batch",
            "eager 1st ms",
            "graphs 1st ms",
            "eager 2nd ms",
            "graphs 2nd ms",
            "eager held MiB",
            "graphs held MiB",
            "eager peak MiB",
            "graphs peak MiB",
            "eager reserved MiB",
            "graphs reserved MiB",
        ],
        rows,
        floatfmt=".1f",
    )
    path = write_json(args.output, "step_graphs_memory", {"steps": args.steps, "eager": eager, "graphs": captured})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

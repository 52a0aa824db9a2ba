"""Where a forward pass of the default DiT spends its time (steps, guidance, decode) on a device.

Run: python -m bench.investigations.profile_forward [--device cuda]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_output, add_repeats, print_table, write_json
from stagemesh.core.params import Params
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.runners import DiffusionRunner, WorkItem
from stagemesh.stage_service.models.weights import ensure_model_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_repeats(parser, 10, "timed runs per case, after 3 untimed ones (default: 10)")
    add_output(parser, "profile_forward")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    model_dir = ensure_model_dir(Path(tempfile.mkdtemp()) / "tiny", PipelineConfig.tiny())
    runner = DiffusionRunner(model_dir, args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows = []
    for size, steps, guidance in [(256, 1, 1.0), (256, 8, 1.0), (256, 8, 4.0), (1024, 1, 1.0), (1024, 8, 4.0)]:
        cond = torch.randn(12, 64, generator=torch.Generator().manual_seed(0)).to(args.device)
        items = [WorkItem("r", Params("p", size, size, steps, guidance, 1, "tensor"), {"hidden_states": cond})]
        for _ in range(3):
            runner.run(items)
        sync()
        start = time.perf_counter()
        for _ in range(args.repeats):
            runner.run(items)
        sync()
        rows.append([size, steps, guidance, (time.perf_counter() - start) / args.repeats * 1e3])
    print_table(["size", "steps", "guidance", "ms per run"], rows, floatfmt=".2f")
    runs = [dict(zip(("size", "steps", "guidance", "ms_per_run"), row)) for row in rows]
    path = write_json(args.output, "profile_forward", {"device": args.device, "repeats": args.repeats, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Where a forward pass of the default DiT spends its time (steps, guidance, decode) on a device.

Run: python bench/investigations/profile_forward.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import print_table
from stagemesh.core.params import Params
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.runners import DiffusionRunner, WorkItem
from stagemesh.stage_service.models.weights import ensure_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
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
        for _ in range(10):
            runner.run(items)
        sync()
        rows.append([size, steps, guidance, (time.perf_counter() - start) / 10 * 1e3])
    print_table(["size", "steps", "guidance", "ms per run"], rows, floatfmt=".2f")


if __name__ == "__main__":
    main()

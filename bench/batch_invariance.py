"""What `batch_invariant` costs: throughput of the embedded DiT with the option off and on.

Off, the worker samples a batch as one (runner.run(batch)); on, it runs each request with the
shapes it has alone (models.batch_invariance.run_items_alone, the worker's own call). Both run
the same requests (prompts of different lengths, so the batch's conditioning is padded to the
longest) in short interleaved rounds, device-synchronized after every batch; each figure is the
median over rounds, the cost the median of the rounds' own ratios (1 - on/off). Each mode's
outputs are also compared with the same requests run alone: "alone-equal" counts the items whose
image is bit-identical.

The stage's default follows the figure at 256x256, batch 4 on the GPU of record (on if the cost is
at most 5 %): python bench/batch_invariance.py --device cuda
On a CPU: python bench/batch_invariance.py --device cpu --threads 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json
from stagemesh.core.params import Params
from stagemesh.stage_service.models.batch_invariance import run_items_alone
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.contract import WorkItem
from stagemesh.stage_service.models.runners import ArRunner, DiffusionRunner
from stagemesh.stage_service.models.weights import default_model_dir, ensure_model_dir

PROMPTS = (
    "a red fox in fresh snow",
    "a lighthouse",
    "an old city street at night, rain on the cobblestones, neon signs reflected in the puddles",
    "tea",
    "a sailing boat on a calm lake at dawn, mist over the water",
    "two cats",
    "a mountain village in the alps under a starry sky",
    "bread",
)
COST_TARGET = 0.05


def make_items(model_dir: Path, device: str, size: int, steps: int, guidance: float, batch: int) -> list[WorkItem]:
    """`batch` requests with the AR stage's real conditioning (different lengths)."""
    ar = ArRunner(model_dir, device)
    items = []
    for i in range(batch):
        params = Params(PROMPTS[i % len(PROMPTS)], size, size, steps, guidance, 1000 + i, "png")
        cond = ar.run([WorkItem(f"r{i}", params)])[0]["hidden_states"]
        items.append(WorkItem(f"r{i}", params, {"hidden_states": cond}))
    return items


class Modes:
    """The two ways a worker runs one batch, over one runner."""

    def __init__(self, runner: DiffusionRunner, items: list[WorkItem], device: str) -> None:
        self.runner = runner
        self.items = items
        self.sync: Callable[[], None] = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.run: dict[str, Callable[[], list]] = {
            "off": lambda: runner.run(items),
            "on": lambda: run_items_alone(runner.run, items),
        }

    def images_per_s(self, mode: str, batches: int) -> float:
        self.sync()
        start = time.perf_counter()
        for _ in range(batches):
            self.run[mode]()
            self.sync()
        return len(self.items) * batches / (time.perf_counter() - start)

    def alone_equal(self, mode: str) -> int:
        """Items whose image in a batch of this mode equals the image of the item run alone."""
        alone = [self.runner.run([item])[0]["image"].cpu() for item in self.items]
        batched = [out["image"].cpu() for out in self.run[mode]()]
        return sum(torch.equal(a, b) for a, b in zip(alone, batched))


def measure(args: argparse.Namespace) -> dict:
    model_dir = ensure_model_dir(Path(args.model_dir), PipelineConfig.tiny())
    items = make_items(model_dir, args.device, args.size, args.steps, args.guidance, args.batch)
    runner = DiffusionRunner(model_dir, args.device, cuda_graphs=args.cuda_graphs)
    modes = Modes(runner, items, args.device)
    for mode in modes.run:
        modes.images_per_s(mode, args.warmup)
    rounds = []
    for r in range(args.rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")  # neither mode always goes first
        rounds.append({mode: modes.images_per_s(mode, args.batches) for mode in order})
    off = statistics.median(r["off"] for r in rounds)
    on = statistics.median(r["on"] for r in rounds)
    cost = statistics.median(1.0 - r["on"] / r["off"] for r in rounds)
    return {
        "off_images_per_s": off,
        "on_images_per_s": on,
        "cost": cost,
        "within_target": cost <= COST_TARGET,
        "alone_equal": {mode: modes.alone_equal(mode) for mode in modes.run},
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model-dir", default=str(default_model_dir()), help="the embedded model (made if absent)")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="the stage's default_steps")
    parser.add_argument("--guidance", type=float, default=4.0, help="the stage's default_guidance")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=10, help="batches per mode per round")
    parser.add_argument("--warmup", type=int, default=3, help="batches per mode before the rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="denoising steps from captured CUDA graphs (the stage default)",
    )
    parser.add_argument("--output", default="bench/results/batch_invariance.json")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    result = measure(args)
    b = args.batch
    print_table(
        ["batch_invariant", "images/s", "alone-equal"],
        [
            ["off", result["off_images_per_s"], f"{result['alone_equal']['off']}/{b}"],
            ["on", result["on_images_per_s"], f"{result['alone_equal']['on']}/{b}"],
        ],
        floatfmt=".2f",
    )
    verdict = "within" if result["within_target"] else "above"
    print(
        f"cost of batch_invariant at {args.size}x{args.size}, batch {b}, {args.steps} steps on {args.device}: "
        f"{result['cost']:+.1%} of throughput ({verdict} the {COST_TARGET:.0%} target)"
    )
    options = {
        "device": args.device,
        "size": args.size,
        "batch": b,
        "steps": args.steps,
        "guidance": args.guidance,
        "rounds": args.rounds,
        "batches": args.batches,
        "threads": torch.get_num_threads(),
        "cuda_graphs": args.cuda_graphs,
    }
    path = write_json(args.output, "batch_invariance", {"options": options, **result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

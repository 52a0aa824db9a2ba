"""What `batch_invariant` costs: throughput of the embedded DiT with the option off and on.

Three ways to run a batch, over the same weights and requests:
  off       the batch sampled as one (runner.run(batch)): the stage without the option;
  on        what the option does for the embedded DiT: every pass runs the stage's
            max_batch_size requests (copies of the first fill a short batch), requests whose
            conditioning pads alike together (DiffusionRunner.invariant_rows);
  per-item  each request as a batch of its own (run_items_alone): what the option does for a
            runner that cannot fix its shapes, shown for comparison.
Cases: a full batch whose prompts pad to one length (what the engine forms under the option), a
full batch of prompts that pad to different lengths (the runner splits it into several passes),
and one request alone (a short batch: on, it computes a full one). Modes run in short interleaved
rounds, device-synchronized after every batch; each figure is the median over rounds, each cost
the median of the rounds' own ratios (1 - mode/off). "alone-equal" counts the requests whose image
in the batch is bit-identical to the image the same mode gives the request alone.

The stage's default follows the cost of "on" for the first case at 256x256, batch 4, on the GPU of
record (on if at most 5 %): python -m bench.batch_invariance --device cuda
On a CPU: python -m bench.batch_invariance --device cpu --threads 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import add_model_dir, add_output, add_repeats, print_table, write_json
from stagemesh.core.params import Params
from stagemesh.stage_service.models.batch_invariance import padding_key, run_items_alone
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.contract import Progress, WorkItem
from stagemesh.stage_service.models.model_dir import default_model_dir
from stagemesh.stage_service.models.runners import ArRunner, DiffusionRunner
from stagemesh.stage_service.models.weights import ensure_model_dir

# 12-27 bytes: the conditioning (bytes + start + 4 decoded tokens) pads to 32 for all of them.
SAME_PAD = ("a red fox in the snow", "a lighthouse at dusk", "two cats on a sofa", "a boat on a lake")
# Pads to 8, 32, 64 and 128.
MIXED_PAD = (
    "tea",
    "a red fox in the snow",
    "an old city street at night, rain on the cobblestones",
    "a sailing boat on a calm lake at dawn, mist over the water, mountains behind it in the morning sun",
)
MODES = ("off", "on", "per-item")
COST_TARGET = 0.05


def make_items(ar: ArRunner, prompts: tuple[str, ...], args: argparse.Namespace) -> list[WorkItem]:
    """One request per prompt, with the AR stage's real conditioning."""
    items = []
    for i, prompt in enumerate(prompts):
        params = Params(prompt, args.size, args.size, args.steps, args.guidance, 1000 + i, "png")
        cond = ar.run([WorkItem(f"r{i}", params)])[0]["hidden_states"]
        items.append(WorkItem(f"r{i}", params, {"hidden_states": cond}))
    return items


class Modes:
    """The three ways to run a batch, on one runner: two runners (two copies of the weights) ran
    the same work up to 12 % apart on 16 CPU threads, so the modes switch the runner's
    invariant_rows instead."""

    def __init__(self, runner: DiffusionRunner, rows: int, device: str) -> None:
        self.sync: Callable[[], None] = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

        def with_rows(count: int) -> Callable[..., list]:
            def run(batch: list[WorkItem], progress: Progress | None = None) -> list:
                runner.invariant_rows = count
                return runner.run(batch, progress)

            return run

        self.run: dict[str, Callable[[list[WorkItem]], list]] = {
            "off": with_rows(0),
            "on": with_rows(rows),
            "per-item": lambda batch: run_items_alone(with_rows(0), batch),
        }

    def images_per_s(self, mode: str, batch: list[WorkItem], batches: int) -> float:
        self.sync()
        start = time.perf_counter()
        for _ in range(batches):
            self.run[mode](batch)
            self.sync()
        return len(batch) * batches / (time.perf_counter() - start)

    def alone_equal(self, mode: str, batch: list[WorkItem]) -> int:
        alone = [self.run[mode]([item])[0]["image"].cpu() for item in batch]
        batched = [out["image"].cpu() for out in self.run[mode](batch)]
        return sum(torch.equal(a, b) for a, b in zip(alone, batched))


def measure_case(modes: Modes, batch: list[WorkItem], args: argparse.Namespace) -> dict:
    for mode in MODES:
        modes.images_per_s(mode, batch, args.warmup)
    rounds = []
    for r in range(args.repeats):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]  # no mode always goes first
        rounds.append({mode: modes.images_per_s(mode, batch, args.batches) for mode in order})
    return {
        "images_per_s": {mode: statistics.median(r[mode] for r in rounds) for mode in MODES},
        "cost": {mode: statistics.median(1.0 - r[mode] / r["off"] for r in rounds) for mode in MODES[1:]},
        "alone_equal": {mode: modes.alone_equal(mode, batch) for mode in MODES},
        "batch": len(batch),
        "padded_lengths": sorted({padding_key(item.inputs)[0][1] for item in batch}),
        "rounds": rounds,
    }


def measure(args: argparse.Namespace) -> dict:
    model_dir = ensure_model_dir(Path(args.model_dir or default_model_dir()), PipelineConfig.tiny())
    ar = ArRunner(model_dir, args.device)
    runner = DiffusionRunner(model_dir, args.device, cuda_graphs=args.cuda_graphs)
    modes = Modes(runner, args.batch, args.device)
    same = make_items(ar, SAME_PAD, args)[: args.batch]
    cases = {
        "one padded length": same,
        "mixed padded lengths": make_items(ar, MIXED_PAD, args)[: args.batch],
        "one request": same[:1],
    }
    return {name: measure_case(modes, batch, args) for name, batch in cases.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_model_dir(parser, "the embedded model, made if absent; default: its cache folder")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument(
        "--batch", type=int, default=4, help="the stage's max_batch_size; each case has four prompts, so at most 4"
    )
    parser.add_argument("--steps", type=int, default=8, help="the stage's default_steps")
    parser.add_argument("--guidance", type=float, default=4.0, help="the stage's default_guidance")
    add_repeats(parser, 7, "rounds of every mode; figures are medians over them (default: 7)", "--rounds")
    parser.add_argument("--batches", type=int, default=10, help="batches per mode per round")
    parser.add_argument("--warmup", type=int, default=3, help="batches per mode before the rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="denoising steps from captured CUDA graphs (the stage default)",
    )
    add_output(parser, "batch_invariance")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    result = measure(args)
    rows = []
    for name, case in result.items():
        for mode in MODES:
            cost = case["cost"].get(mode)
            rows.append(
                [
                    f"{name} (batch {case['batch']})",
                    mode,
                    case["images_per_s"][mode],
                    "" if cost is None else f"{cost:+.1%}",
                    f"{case['alone_equal'][mode]}/{case['batch']}",
                ]
            )
    print_table(["case", "mode", "images/s", "cost", "alone-equal"], rows, floatfmt=".2f")
    head = result["one padded length"]
    cost = head["cost"]["on"]
    verdict = "within" if cost <= COST_TARGET else "above"
    print(
        f"cost of batch_invariant at {args.size}x{args.size}, batch {args.batch}, {args.steps} steps on "
        f"{args.device}: {cost:+.1%} of throughput ({verdict} the {COST_TARGET:.0%} target)"
    )
    options = {
        "device": args.device,
        "size": args.size,
        "batch": args.batch,
        "steps": args.steps,
        "guidance": args.guidance,
        "rounds": args.repeats,
        "batches": args.batches,
        "threads": torch.get_num_threads(),
        "cuda_graphs": args.cuda_graphs,
    }
    summary = {"cost": cost, "within_target": cost <= COST_TARGET}
    path = write_json(args.output, "batch_invariance", {"options": options, **summary, "cases": result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""DLO across data-parallel GPUs: AllGather against no-AllGather and resident, and DP-wave QPS.

One process per GPU joins an NCCL group (NVLink multicast stays off: NCCL_NVLS_ENABLE=0). Every
rank builds the same random weights (bench/dlo_models.py), so outputs can be compared. Cases, on
every rank at once unless said otherwise:

- bandwidths: pinned H2D of the largest block (rank 0 alone, then every rank at once) and the
  all-gather of the largest block (bytes of the gathered block per second);
- resident: the whole model on each GPU;
- DLO no-AllGather: each rank streams whole blocks from its own host copy (rank 0 alone: one
  GPU's DLO; then every rank at once);
- DLO AllGather: each rank keeps 1/dp of every block in pinned host memory, moves only that over
  its host link and rebuilds the block over NVLink;
- DP waves: dp requests at once, one per rank, `--wave-steps` denoising steps each, under
  AllGather DLO (what the stage's wave scheduler runs), against one GPU's DLO alone.

Floor of an AllGather step on one rank: max(resident step, streamed bytes / dp / H2D bandwidth
with every rank copying + streamed bytes / all-gather bandwidth). Correctness: the AllGather
output must equal the no-AllGather output bit for bit, and the resident one within bf16 noise.

Run on >= 2 GPUs:  python -m bench.dlo_multi_gpu --preset flux
Check on a CPU:    python -m bench.dlo_multi_gpu --preset tiny-flux --device cpu --dp 2
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import dlo, dlo_timing
from bench import dlo_models as models
from bench.common import add_output, add_preset, print_table, write_json
from stagemesh.core.procutil import free_port
from stagemesh.stage_service.offload.collective import gather_into


# ---- per rank --------------------------------------------------------------------------------
class Rank:
    def __init__(self, rank: int, world: int, args: argparse.Namespace) -> None:
        self.rank, self.world, self.args = rank, world, args
        cuda = args.device == "cuda"
        self.device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        self.group = dist.group.WORLD
        self.bm = dlo._bench_model(args)
        self.blocks = dlo._block_bytes(self.bm)

    def barrier(self) -> None:
        dlo_timing.sync(self.device)
        dist.barrier(device_ids=[self.rank] if self.device.type == "cuda" else None)

    def alone(self, fn):
        """Run `fn` on rank 0 while the others wait (one GPU's figure, nothing else copying)."""
        self.barrier()
        result = fn() if self.rank == 0 else None
        self.barrier()
        return result

    def allgather_bandwidth(self, nbytes: int, repeats: int = 10) -> float:
        shard = -(-nbytes // self.world)
        src = torch.randint(0, 255, (shard,), dtype=torch.uint8, device=self.device)
        out = torch.empty(shard * self.world, dtype=torch.uint8, device=self.device)
        gather_into(out, src, self.group)
        self.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            gather_into(out, src, self.group)
        self.barrier()
        return out.numel() * repeats / (time.perf_counter() - start)

    def timed(self, model, size: int) -> tuple[float, torch.Tensor]:
        self.barrier()
        return dlo._timed(self.bm, model, self.device, self.args, size)

    def wave(self, model) -> float:
        """Seconds for `wave_steps` denoising steps of this rank's own request."""
        inputs = self.bm.make_inputs(self.args.wave_size, self.args.text_tokens, self.device)
        first = next(iter(inputs))  # the latents: each rank's request differs
        g = torch.Generator().manual_seed(1000 + self.rank)
        noise = torch.randn(inputs[first].shape, generator=g).to(inputs[first])
        inputs[first] = inputs[first] + noise
        with torch.inference_mode():
            self.bm.forward(model, inputs)
            dlo_timing.sync(self.device)
            start = time.perf_counter()
            for _ in range(self.args.wave_steps):
                self.bm.forward(model, inputs)
            dlo_timing.sync(self.device)
        return time.perf_counter() - start

    def run(self) -> dict:
        a, sizes, big = self.args, self.args.sizes, max(self.blocks)
        out: dict = {
            "rank": self.rank,
            "blocks": len(self.blocks),
            "block_bytes": sum(self.blocks),
            "max_block_bytes": big,
        }
        out["h2d_alone"] = self.alone(lambda: dlo_timing.h2d_bandwidth(big, self.device))
        self.barrier()
        out["h2d_all"] = dlo_timing.h2d_bandwidth(big, self.device)
        out["allgather"] = self.allgather_bandwidth(big)

        model = models.build_resident(self.bm, self.device)
        resident = {s: self.timed(model, s) for s in sizes}
        out["resident_wave_s"] = self.wave(model)
        del model
        dlo._free(self.device)
        out["resident"] = {s: t for s, (t, _) in resident.items()}

        model, engine = models.build_offloaded(self.bm, self.device, 0)
        out["plain_h2d_bytes"] = engine.stats().h2d_bytes_per_iteration
        alone = {s: self.alone(functools.partial(dlo._timed, self.bm, model, self.device, a, s)) for s in sizes}
        out["plain_alone"] = {s: r[0] for s, r in alone.items() if r is not None}
        out["plain_alone_wave_s"] = self.alone(functools.partial(self.wave, model))
        plain = {s: self.timed(model, s) for s in sizes}
        out["plain_all"] = {s: t for s, (t, _) in plain.items()}
        out["plain_wave_s"] = self.wave(model)
        engine.close()
        engine.store.close()
        del model, engine
        dlo._free(self.device)

        model, engine = models.build_offloaded(self.bm, self.device, 0, self.group)
        stats = engine.stats()
        out["gather_h2d_bytes"], out["gather_host_bytes"] = (stats.h2d_bytes_per_iteration, stats.host_bytes)
        gathered = {s: self.timed(model, s) for s in sizes}
        out["gather"] = {s: t for s, (t, _) in gathered.items()}
        self.barrier()
        out["gather_wave_s"] = self.wave(model)
        self.barrier()
        engine.close()
        engine.store.close()
        del model, engine
        dlo._free(self.device)

        out["equal_to_no_allgather"] = {s: bool(torch.equal(gathered[s][1], plain[s][1])) for s in sizes}
        out["max_diff_resident"] = {s: float((gathered[s][1] - resident[s][1]).abs().max()) for s in sizes}
        return out


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    backend = "nccl" if args.device == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.manual_seed(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kwargs)
    try:
        result = Rank(rank, world, args).run()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# ---- report ----------------------------------------------------------------------------------
def _worst(ranks: list[dict], key: str, size=None) -> float:
    """The slowest rank's figure: a step (or wave) is done when every rank is."""
    values = [r[key][str(size)] if size is not None else r[key] for r in ranks]
    return max(v for v in values if v is not None)


def summarize(ranks: list[dict], world: int, args) -> tuple[list[dict], dict]:
    r0 = ranks[0]
    h2d_all = min(r["h2d_all"] for r in ranks)
    ag = min(r["allgather"] for r in ranks)
    streamed = r0["block_bytes"]
    rows = []
    for size in args.sizes:
        resident = _worst(ranks, "resident", size)
        floor_gather = max(resident, streamed / world / h2d_all + streamed / ag)
        floor_plain = max(resident, streamed / h2d_all)
        floor_alone = max(resident, streamed / r0["h2d_alone"])
        for case, key, floor in (
            ("resident", "resident", None),
            ("DLO no-AllGather, 1 GPU", "plain_alone", floor_alone),
            (f"DLO no-AllGather, {world} GPUs", "plain_all", floor_plain),
            (f"DLO AllGather, {world} GPUs", "gather", floor_gather),
        ):
            seconds = r0[key][str(size)] if key == "plain_alone" else _worst(ranks, key, size)
            rows.append(
                {
                    "case": case,
                    "size": size,
                    "step_s": seconds,
                    "floor_s": floor,
                    "ratio": None if floor is None else seconds / floor,
                    "equal_to_no_allgather": all(r["equal_to_no_allgather"][str(size)] for r in ranks)
                    if key == "gather"
                    else None,
                    "max_diff_resident": max(r["max_diff_resident"][str(size)] for r in ranks)
                    if key == "gather"
                    else None,
                }
            )
    one_gpu_qps = 1.0 / r0["plain_alone_wave_s"]
    waves = {
        "wave_size": args.wave_size,
        "wave_steps": args.wave_steps,
        "one_gpu_dlo_qps": one_gpu_qps,
        "resident_qps": world / _worst(ranks, "resident_wave_s"),
        "no_allgather_qps": world / _worst(ranks, "plain_wave_s"),
        "allgather_qps": world / _worst(ranks, "gather_wave_s"),
    }
    waves["allgather_scaling"] = waves["allgather_qps"] / one_gpu_qps
    waves["no_allgather_scaling"] = waves["no_allgather_qps"] / one_gpu_qps
    bandwidths = {
        "h2d_alone_bytes_per_s": r0["h2d_alone"],
        "h2d_all_bytes_per_s": h2d_all,
        "allgather_bytes_per_s": ag,
        "streamed_bytes": streamed,
        "h2d_bytes_per_rank": {"no_allgather": r0["plain_h2d_bytes"], "allgather": r0["gather_h2d_bytes"]},
        "host_bytes_per_rank_allgather": r0["gather_host_bytes"],
    }
    return rows, {"waves": waves, "bandwidths": bandwidths}


def _fmt(value, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def report(rows: list[dict], extra: dict, world: int) -> None:
    b, w = extra["bandwidths"], extra["waves"]
    print(
        f"H2D {b['h2d_alone_bytes_per_s'] / 1e9:.1f} GB/s alone, "
        f"{b['h2d_all_bytes_per_s'] / 1e9:.1f} GB/s per rank with {world} copying; all-gather "
        f"{b['allgather_bytes_per_s'] / 1e9:.1f} GB/s; per-rank H2D per step "
        f"{b['h2d_bytes_per_rank']['no_allgather'] / 1e9:.2f} GB (no-AllGather) vs "
        f"{b['h2d_bytes_per_rank']['allgather'] / 1e9:.2f} GB (AllGather)"
    )
    print_table(
        ["case", "size", "step ms", "floor ms", "ratio", "== no-AG", "max |diff| vs res"],
        [
            [
                r["case"],
                r["size"],
                _fmt(r["step_s"], 1e3, 1),
                _fmt(r["floor_s"], 1e3, 1),
                _fmt(r["ratio"]),
                "-" if r["equal_to_no_allgather"] is None else r["equal_to_no_allgather"],
                _fmt(r["max_diff_resident"], 1.0, 4),
            ]
            for r in rows
        ],
    )
    print_table(
        ["waves", "QPS", "x one GPU's DLO"],
        [
            ["one GPU, DLO", _fmt(w["one_gpu_dlo_qps"]), "1.000"],
            [f"{world} GPUs, resident", _fmt(w["resident_qps"]), "-"],
            [f"{world} GPUs, DLO no-AllGather", _fmt(w["no_allgather_qps"]), _fmt(w["no_allgather_scaling"])],
            [f"{world} GPUs, DLO AllGather", _fmt(w["allgather_qps"]), _fmt(w["allgather_scaling"])],
        ],
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, dlo.PRESETS, "flux", "--model", "--tiny-flux")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dp", type=int, default=None, help="ranks (default: every visible GPU; 2 on the CPU)")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=None, help="image sizes (default: 512 1024; CPU-sized models: 128)"
    )
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--wave-size", type=int, default=None, help="image size of the DP-wave requests (default: the largest size)"
    )
    parser.add_argument("--wave-steps", type=int, default=8, help="denoising steps per wave request")
    add_output(parser, "dlo_multi_gpu", "--json")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    small = args.preset.startswith("tiny")
    args.sizes = args.sizes or ([128] if small else [512, 1024])
    args.wave_size = args.wave_size or max(args.sizes)
    if args.dp is None:
        args.dp = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.dp < 2:
        parser.error(f"--dp must be at least 2 (got {args.dp}); DLO AllGather needs a group")
    if args.device == "cuda" and args.dp > torch.cuda.device_count():
        parser.error(f"--dp {args.dp} but {torch.cuda.device_count()} GPU(s) visible")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # NVLink multicast (NVLS) stays off: it is not needed for all-gather of this size.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(args.dp, free_port(), args, out_dir), nprocs=args.dp, join=True)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.dp)]
    rows, extra = summarize(ranks, args.dp, args)
    report(rows, extra, args.dp)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    path = write_json(
        args.output,
        "dlo_multi_gpu",
        {
            "model": args.preset,
            "dp": args.dp,
            "gpu": gpu,
            "device": args.device,
            "text_tokens": args.text_tokens,
            "steps": args.steps,
            "warmup": args.warmup,
            "rows": rows,
            **extra,
            "ranks": ranks,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

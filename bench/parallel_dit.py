"""Sequence-parallel step time of a FLUX-size transformer on 1, 2 and 4 ranks (sp_size = N).

One process per rank, spawned here (NCCL on GPUs, NVLink multicast off; gloo on the CPU). Every
rank builds the same random weights (bench/dlo_models.py: diffusers' FluxTransformer2DModel with
FLUX.1-dev's shape, bf16, resident) and runs what a stage with sp_size = N runs per denoising
step: the sequence-parallel family of the diffusers adapter (its slice of the packed image tokens
through the transformer, attention across the ranks by the stage's processor, the velocity
gathered) and the Euler update. One image, 512 text tokens, `--steps` steps (28: FLUX.1-dev's
default) after `--warmup`; the step time is rank 0's wall clock over the timed steps (every
step ends with a gather, so no rank runs ahead).

Correctness: the gathered velocity of the first timed step against the one-rank run's, max |Δ|
(bf16: different attention shapes round differently).

Targets: >= 1.8x on 2 GPUs at 2048², >= 3.2x on 4.

Peer: xDiT's published FLUX.1-dev figures (docs/performance/flux.md of xdit-project/xDiT, 28
steps, 1024px, 4xH100, whole-pipeline latency in seconds, without and with torch.compile): 1 GPU
6.71 / 4.30, Ulysses-2 4.38 / 2.68, Ulysses-4 4.24 / 1.63; the same page gives 4xH20 (SP=4)
2.02 s against 1xH20 6.10 s (without compile; 1.81 / 5.02 with), resolution not stated there.
It publishes no table for 2048px. The xDiT column shows its speed-up where size and rank count
match (1024px, Ulysses-N, without compile, as here); its latency includes the text encoders and
the VAE, which split nothing, so its speed-up of the transformer alone is higher.

Run on N GPUs:  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
                python -m bench.parallel_dit --ranks 1 2 4
Check on a CPU: python -m bench.parallel_dit --device cpu --preset tiny-flux --sizes 64 128 --ranks 1 2 3 \\
                --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import dlo_models as models
from bench.common import add_output, add_preset, print_table, usable_cpus, write_json
from stagemesh.core.procutil import free_port

TARGETS = {(2048, 2): 1.8, (2048, 4): 3.2}
XDIT_SOURCE = "github.com/xdit-project/xDiT docs/performance/flux.md (FLUX.1-dev, 28 steps, 4xH100)"
# ranks -> seconds per 1024px image, xDiT with Ulysses-N, without torch.compile
XDIT_H100_1024_EAGER = {1: 6.71, 2: 4.38, 4: 4.24}
XDIT_H100_1024_COMPILED = {1: 4.30, 2: 2.68, 4: 1.63}
# Multicast stays off: these collectives do not need it, and it fails where the fabric lacks it.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ---- per rank --------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _family(model, rank: int, world: int):
    """What a stage with sp_size = world samples with (the diffusers adapter's own wrapper)."""
    from stagemesh.stage_service.models.diffusers_adapter.families import FLUX
    from stagemesh.stage_service.models.diffusers_adapter.parallel import for_sampling
    from stagemesh.stage_service.models.parallel import form_axes

    return for_sampling(FLUX, model, form_axes(world, 1, rank))


def _denoise(family, model, inputs: dict, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` Euler steps from inputs["hidden_states"]; (latents, first velocity)."""
    cond = {k: inputs[k] for k in ("encoder_hidden_states", "pooled_projections", "txt_ids", "img_ids", "guidance")}
    x, first = inputs["hidden_states"], None
    for i in range(steps):
        t = torch.tensor(1000.0 * (1 - i / steps), device=x.device)
        v = family.predict(model, x, t, cond, 3.5)
        first = v if first is None else first
        x = x + (-1.0 / steps) * v
    assert first is not None
    return x, first


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    kwargs = {"device_id": device} if cuda else {}
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, usable_cpus() // world))
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kwargs)
    try:
        bm = models.flux_model(tiny=args.preset == "tiny-flux")
        model = models.build_resident(bm, device)
        family = _family(model, rank, world)
        rows = {}
        with torch.inference_mode():
            for size in args.sizes:
                inputs = bm.make_inputs(size, args.text_tokens, device)
                _denoise(family, model, inputs, args.warmup)
                _sync(device)
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                dist.barrier()
                start = time.perf_counter()
                _, first = _denoise(family, model, inputs, args.steps)
                _sync(device)
                seconds = (time.perf_counter() - start) / args.steps
                peak = torch.cuda.max_memory_allocated(device) if cuda else 0
                if rank == 0:
                    torch.save(first.float().cpu(), Path(out_dir, f"v{world}-{size}.pt"))
                rows[size] = {"step_s": seconds, "peak_bytes": peak}
        Path(out_dir, f"world{world}-rank{rank}.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


# ---- driver ----------------------------------------------------------------------------------
def _run_world(world: int, args: argparse.Namespace, out_dir: str) -> dict | None:
    """Every rank's figures per size, or None where the machine lacks the GPUs."""
    if args.device == "cuda" and world > torch.cuda.device_count():
        return None
    mp.spawn(_rank_main, args=(world, free_port(), args, out_dir), nprocs=world, join=True)
    ranks = [json.loads(Path(out_dir, f"world{world}-rank{r}.json").read_text()) for r in range(world)]
    return {
        int(size): {
            "step_s": max(r[size]["step_s"] for r in ranks),
            "peak_bytes": max(r[size]["peak_bytes"] for r in ranks),
        }
        for size in ranks[0]
    }


def _xdit(size: int, world: int) -> str:
    if size != 1024 or world not in XDIT_H100_1024_EAGER or world == 1:
        return "—"
    return f"{XDIT_H100_1024_EAGER[1] / XDIT_H100_1024_EAGER[world]:.2f}x"


def _report(results: dict[int, dict | None], args: argparse.Namespace, out_dir: str) -> list[dict]:
    rows = []
    for size in args.sizes:
        base = results.get(1)
        ref = torch.load(Path(out_dir, f"v1-{size}.pt")) if base is not None else None
        for world in args.ranks:
            got = results[world]
            row: dict = {"size": size, "ranks": world, "target": TARGETS.get((size, world)), "xdit": _xdit(size, world)}
            if got is None:
                row["blocked"] = f"needs {world} GPUs, {torch.cuda.device_count()} visible"
                rows.append(row)
                continue
            row["step_s"] = got[size]["step_s"]
            row["peak_bytes"] = got[size]["peak_bytes"]
            if base is not None and ref is not None:
                row["speedup"] = base[size]["step_s"] / row["step_s"]
                v = torch.load(Path(out_dir, f"v{world}-{size}.pt"))
                row["max_diff"] = float((v - ref).abs().max())
            rows.append(row)
    return rows


def _print(rows: list[dict], steps: int) -> None:
    def fmt(row: dict) -> list:
        if "blocked" in row:
            return [row["size"], row["ranks"], "blocked", row["blocked"], "", _target(row), "", "", row["xdit"]]
        speed = f"{row['speedup']:.2f}x" if "speedup" in row else "—"
        met = ""
        if row["target"] is not None and "speedup" in row:
            met = " ok" if row["speedup"] >= row["target"] else " MISSED"
        return [
            row["size"],
            row["ranks"],
            f"{row['step_s'] * 1e3:.1f}",
            f"{row['step_s'] * steps:.2f}",
            speed,
            _target(row) + met,
            f"{row['max_diff']:.1e}" if "max_diff" in row else "—",
            f"{row['peak_bytes'] / 2**30:.1f}",
            row["xdit"],
        ]

    headers = ["size", "ranks", "step ms", f"{steps} steps s", "speed-up", "target", "max |Δ| vs 1", "peak GiB"]
    print_table([*headers, "xDiT speed-up"], [fmt(r) for r in rows])
    print(f"xDiT: {XDIT_SOURCE}; 1024px, Ulysses-N, eager, whole pipeline. Published seconds per image:")
    for world in sorted(XDIT_H100_1024_EAGER):
        eager, compiled = XDIT_H100_1024_EAGER[world], XDIT_H100_1024_COMPILED[world]
        print(f"  {world} GPU(s): {eager:.2f} s eager, {compiled:.2f} s torch.compile")
    print("  4xH20 (SP=4) 2.02 s vs 1xH20 6.10 s eager (resolution not stated); no 2048px table is published")


def _target(row: dict) -> str:
    return f">= {row['target']:.1f}x" if row["target"] is not None else ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    add_preset(parser, ("flux", "tiny-flux"), "flux", "--tiny")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048], help="image sides in pixels")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="sp_size values to run")
    parser.add_argument("--steps", type=int, default=28, help="timed denoising steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--text-tokens", type=int, default=512, help="T5 tokens (FLUX.1-dev: 512)")
    add_output(parser, "parallel_dit", "--out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if 1 not in args.ranks:
        args.ranks = [1, *args.ranks]  # the speed-up is against one rank
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory() as out_dir:
        results = {world: _run_world(world, args, out_dir) for world in args.ranks}
        rows = _report(results, args, out_dir)
    _print(rows, args.steps)
    path = write_json(
        args.output,
        "parallel_dit",
        {
            "model": args.preset,
            "device": args.device,
            "steps": args.steps,
            "text_tokens": args.text_tokens,
            "rows": rows,
            "targets": {f"{s}px/{n}": t for (s, n), t in TARGETS.items()},
            "xdit": {"source": XDIT_SOURCE, "eager_s": XDIT_H100_1024_EAGER, "compiled_s": XDIT_H100_1024_COMPILED},
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""DLO step time against the transfer floor, on the FLUX-sized DiT (11.9 B params, bf16).

For each image size: resident step time (whole model on the device), measured pinned H2D
bandwidth, and DLO (no-AllGather) step time with 0 and with N resident blocks. The floor of a
streamed step is max(resident step, streamed bytes / H2D bandwidth); the ratio says how close
DLO gets to it. Weights are random, generated block by block (never twice in host memory) and
identical between the resident and the DLO model, so their outputs are compared too.

Run on a GPU:   python bench/dlo.py
Check on a CPU: python bench/dlo.py --preset tiny --device cpu
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import zlib
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, print_table, write_json  # noqa: E402
from stage_service import platform  # noqa: E402
from stage_service.models.config import DiTConfig, PipelineConfig  # noqa: E402
from stage_service.models.dit import DiT  # noqa: E402
from stage_service.offload import LayerwiseOffload  # noqa: E402

TINY = PipelineConfig(dit=DiTConfig(hidden_size=256, depth=12, num_heads=4, cond_dim=64))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill(t: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """Deterministic values for parameter `name`, generated on `device`."""
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    return t.normal_(0.0, 0.02, generator=gen)


def _materialize(module: nn.Module, prefix: str, device: torch.device, target: torch.device,
                 skip: str | None = None) -> None:
    """Give every parameter under `module` real values (generated on `device`, stored on
    `target`), one tensor at a time."""
    for name, sub in module.named_modules():
        full = f"{prefix}{name}" if name else prefix.rstrip(".")
        if skip is not None and (full == skip or full.startswith(skip + ".")):
            continue
        for key, p in list(sub._parameters.items()):
            if p is None:
                continue
            qual = f"{full}.{key}" if full else key
            value = _fill(torch.empty(p.shape, dtype=p.dtype, device=device), qual, device)
            sub._parameters[key] = nn.Parameter(value.to(target), requires_grad=False)


def _meta_dit(config: PipelineConfig) -> DiT:
    with torch.device("meta"):
        return DiT(config.dit).to(config.torch_dtype).eval().requires_grad_(False)


def build_resident(config: PipelineConfig, device: torch.device) -> DiT:
    dit = _meta_dit(config)
    _materialize(dit, "", device, device)
    return dit


def build_offloaded(config: PipelineConfig, device: torch.device, resident: int
                    ) -> tuple[DiT, LayerwiseOffload]:
    dit = _meta_dit(config)
    _materialize(dit, "", device, device, skip="blocks")
    paths = {id(b): f"blocks.{i}" for i, b in enumerate(dit.blocks)}

    def init_block(block: nn.Module) -> None:
        # Resident blocks are materialised straight on the device, streamed ones on the host.
        target = device if int(paths[id(block)].split(".")[1]) < resident else torch.device("cpu")
        _materialize(block, paths[id(block)] + ".", device, target)

    for i in range(resident):
        init_block(dit.blocks[i])
    engine = LayerwiseOffload(dit, device, resident_layers=resident, use_allgather=False,
                              init_block=init_block)
    return dit, engine


def h2d_bandwidth(nbytes: int, device: torch.device, repeats: int = 10) -> float:
    """Bytes per second of pinned host -> device copies of `nbytes`."""
    host = platform.HostBuffer(nbytes, device)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host.tensor, non_blocking=True)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dev.copy_(host.tensor, non_blocking=True)
    _sync(device)
    elapsed = time.perf_counter() - start
    host.close()
    return nbytes * repeats / elapsed


def _inputs(config: PipelineConfig, size: int, tokens: int, device: torch.device):
    c = config.dit
    side = size // c.vae_scale
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, c.latent_channels, side, side, generator=g)  # guidance: cond + uncond
    cond = torch.randn(2, tokens, c.cond_dim, generator=g).to(config.torch_dtype)
    return x.to(device), torch.full((2,), 0.7, device=device), cond.to(device)


def step_time(dit: DiT, inputs, device: torch.device, steps: int, warmup: int
              ) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        for _ in range(warmup):
            out = dit(*inputs)
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            out = dit(*inputs)
        _sync(device)
    return (time.perf_counter() - start) / steps, out.float().cpu()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def _model_bytes(dit: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in dit.parameters())


def _block_bytes(config: PipelineConfig) -> int:
    return _model_bytes(_meta_dit(config).blocks[0])


def run_resident(config, device, args) -> dict[int, dict]:
    dit = build_resident(config, device)
    weights = _model_bytes(dit)
    out = {}
    for size in args.sizes:
        _free(device)
        seconds, result = step_time(dit, _inputs(config, size, args.text_tokens, device), device,
                                    args.steps, args.warmup)
        out[size] = {"step_s": seconds, "output": result, "weights_bytes": weights,
                     "activation_bytes": max(0, _peak(device) - weights)}
    del dit
    _free(device)
    return out


def run_offloaded(config, device, args, resident: int, reference: dict[int, dict],
                  bandwidth: float) -> list[dict]:
    dit, engine = build_offloaded(config, device, resident)
    stats = engine.stats()
    model_bytes = _model_bytes(dit)
    slots_and_rest = stats.slot_bytes + model_bytes - stats.payload_bytes
    rows = []
    for size in args.sizes:
        _free(device)
        seconds, result = step_time(dit, _inputs(config, size, args.text_tokens, device), device,
                                    args.steps, args.warmup)
        ref = reference[size]
        floor = max(ref["step_s"], stats.h2d_bytes_per_iteration / bandwidth)
        rows.append({
            "size": size, "resident_blocks": resident, "step_s": seconds, "floor_s": floor,
            "ratio": seconds / floor, "resident_step_s": ref["step_s"],
            "streamed_bytes": stats.h2d_bytes_per_iteration, "host_bytes": stats.host_bytes,
            "host_over_model": stats.host_bytes / model_bytes, "peak_device_bytes": _peak(device),
            "peak_bound_bytes": slots_and_rest + ref["activation_bytes"],
            "max_abs_diff": float((result - ref["output"]).abs().max()),
        })
    engine.close()
    del dit, engine
    _free(device)
    return rows


def _table(rows: list[dict]) -> None:
    gb = 1e9
    print_table(
        ["size", "resident blocks", "step ms", "resident ms", "floor ms", "ratio", "streamed GB",
         "peak dev GB", "bound GB", "host/model", "max |diff|"],
        [[r["size"], r["resident_blocks"], r["step_s"] * 1e3, r["resident_step_s"] * 1e3,
          r["floor_s"] * 1e3, r["ratio"], r["streamed_bytes"] / gb, r["peak_device_bytes"] / gb,
          r["peak_bound_bytes"] / gb, r["host_over_model"], r["max_abs_diff"]] for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=("flux-sized", "tiny"), default="flux-sized")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="image sizes in pixels (default: 512 1024; tiny: 128 256)")
    parser.add_argument("--resident-blocks", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="timed denoising steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=str(RESULTS_DIR / "dlo.json"))
    args = parser.parse_args()
    config = PipelineConfig.flux_sized() if args.preset == "flux-sized" else TINY
    args.sizes = args.sizes or ([512, 1024] if args.preset == "flux-sized" else [128, 256])
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    bandwidth = h2d_bandwidth(_block_bytes(config), device)
    print(f"H2D {bandwidth / 1e9:.1f} GB/s (pinned, one block per copy)", flush=True)
    reference = run_resident(config, device, args)
    rows = []
    for resident in args.resident_blocks:
        rows += run_offloaded(config, device, args, resident, reference, bandwidth)
    _table(rows)
    path = write_json(args.json, "dlo", {
        "preset": args.preset, "device": str(device), "dtype": config.dtype,
        "params": sum(p.numel() for p in _meta_dit(config).parameters()),
        "h2d_bytes_per_s": bandwidth, "text_tokens": args.text_tokens, "steps": args.steps,
        "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Where the FP8 DLO step loses time against its transfer floor: one FP8 engine on the FLUX-shaped
transformer, re-armed between variants of the rebuild (the kernel that turns FP8 + scales back
into the model's dtype: torch's two passes or the one-pass Triton kernel), the number of FP8
staging buffers the copies land in, and the rebuild stream's priority. For each: the steady
step (bench/dlo_timing.step_time), the link's idle time per step, and, apart, one step's worth of
rebuilds alone on an idle device.

Run on a GPU: python -m bench.investigations.fp8_rebuild
CPU check:    python -m bench.investigations.fp8_rebuild --device cpu --preset tiny-flux --size 64 --steps 1 --warmup 1
"""

from __future__ import annotations

import argparse
import time

import torch

from bench import dlo_models as models
from bench.common import add_output, add_preset, print_table, write_json
from bench.dlo_timing import h2d_bandwidth, link_timeline, step_time, sync
from stagemesh.stage_service import platform
from stagemesh.stage_service.offload import dequant, quant

VARIANTS = [  # (kernel, staging buffers, rebuild stream priority)
    ("torch", 2, 0),  # as before the change
    ("torch", 3, 0),
    ("triton", 2, 0),
    ("triton", 3, 0),
    ("triton", 3, -1),
    ("triton", 4, -1),
]


def rearm(engine, staging: int, priority: int) -> None:
    """Give the engine `staging` FP8 buffers and a rebuild stream of `priority` (slots re-made)."""
    engine.release_device()
    dev = engine.device
    engine._staging = staging
    engine._copied = [platform.DeviceEvent(dev) for _ in range(staging)]
    engine._consumed = [platform.DeviceEvent(dev) for _ in range(staging)]
    engine._comm = platform.Stream(dev, priority)
    engine.restore_device()


def rebuild_alone(engine, kernel: str, device: torch.device) -> float:
    """Seconds to rebuild every streamed block once from a packed buffer, nothing else running."""
    dequant.KERNEL = kernel
    packed, slot = engine._packed[0], engine._slots[0]
    sync(device)
    started = time.perf_counter()
    for layout in engine.streams:
        layout.expand(packed[: layout.nbytes], slot)
    sync(device)
    return time.perf_counter() - started


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_preset(parser, ("flux", "tiny-flux"), "flux", "--tiny")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    add_output(parser, "fp8_rebuild", "--json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    bm = models.flux_model(
        tiny=args.preset == "tiny-flux", dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    model, engine = models.build_offloaded(bm, device, 0, stream_dtype=quant.FLOAT8)
    streamed = engine.stats().h2d_bytes_per_iteration
    bandwidth = h2d_bandwidth(min(streamed, 4 << 30), device)
    floor = streamed / bandwidth
    inputs = bm.make_inputs(args.size, args.text_tokens, device)
    rows, report = [], []
    for kernel, staging, priority in VARIANTS:
        rearm(engine, staging, priority)
        dequant.KERNEL = kernel
        seconds, _ = step_time(bm, model, inputs, device, args.steps, args.warmup)
        link = link_timeline(engine, bm, model, inputs, device, args.steps, args.warmup)
        alone = rebuild_alone(engine, kernel, device)
        report.append(
            {"kernel": kernel, "staging": staging, "priority": priority, "step_s": seconds, "rebuild_alone_s": alone}
            | link
        )
        rows.append([kernel, staging, priority, seconds * 1e3, seconds / floor, link["link_idle_s"] * 1e3, alone * 1e3])
    print(f"FP8 streamed {streamed / 1e9:.2f} GB per step, H2D {bandwidth / 1e9:.1f} GB/s: floor {floor * 1e3:.1f} ms")
    print_table(
        ["rebuild", "staging", "priority", "step ms", "x fp8 floor", "link idle ms", "rebuild alone ms"],
        rows,
        floatfmt=".2f",
    )
    print(f"wrote {write_json(args.output, 'fp8_rebuild', {'floor_s': floor, 'variants': report})}")


if __name__ == "__main__":
    main()

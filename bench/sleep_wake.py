"""Sleep and wake of a stage holding >= 20 GB of bf16 weights, against the copy bandwidth floor
and a naive module.to("cpu") / module.to("cuda").

One run measures: pinned copy bandwidth each way; level 1 sleep and wake; level 2 sleep and wake
(reload from a page-cache-hot safetensors checkpoint through a memory map); the naive path.
Targets: level 1 sleep and wake >= 0.8 x pinned bandwidth; level 2 wake >= 0.5 x pinned H2D.
Run on a GPU: python bench/sleep_wake.py [--gib 20]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json
from stagemesh.stage_service.models.contract import WeightFile
from stagemesh.stage_service.worker.sleep import SleepController
from stagemesh.weight_store.safetensors_writer import write_streamed

LAYER_SHAPE = (8192, 8192)  # 128 MiB per bf16 weight: FLUX-like large matrices


def build_model(gib: float, device: str) -> nn.Module:
    per_layer = LAYER_SHAPE[0] * LAYER_SHAPE[1] * 2
    layers = max(1, int(gib * 2**30 // per_layer))
    model = nn.ModuleList(
        nn.Linear(*LAYER_SHAPE, bias=True, device="meta", dtype=torch.bfloat16) for _ in range(layers)
    )
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)  # never time on zeros
    return model


def pinned_bandwidth(device: str, nbytes: int = 4 << 30) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.random_()
    results = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        results.append(3 * nbytes / (time.perf_counter() - start) / 1e9)
    del host, dev
    torch.cuda.empty_cache()
    return results[0], results[1]


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=20.0, help="weights to hold, GiB of bf16")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--output", default="bench/results/sleep_wake.json")
    args = parser.parse_args()
    device = "cuda:0"
    h2d, d2h = pinned_bandwidth(device)
    model = build_model(args.gib, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ckpt = Path(args.dir or tempfile.mkdtemp()) / "model.safetensors"
    state = model.state_dict()
    write_streamed(ckpt, [(k, tuple(v.shape), v.dtype) for k, v in state.items()], state.values())
    del state  # it references the weights' storage: holding it would keep them on the device
    with open(ckpt, "rb") as f:  # page-cache hot, as after a recent load
        while f.read(1 << 26):
            pass
    reference = model[0].weight[:4, :8].float().cpu().clone()

    controller = SleepController([WeightFile(ckpt, {"": model})], device)
    rows, report = [], {"weight_bytes": weight_bytes, "pinned_h2d_gbps": h2d, "pinned_d2h_gbps": d2h}
    for level in (1, 2, 1):  # the second level-1 cycle reuses the host buffer
        free_before = torch.cuda.mem_get_info()[0]
        sleep_s = timed(functools.partial(controller.sleep, level))
        freed = torch.cuda.mem_get_info()[0] - free_before
        wake_s = timed(controller.wake)
        assert torch.equal(model[0].weight[:4, :8].float().cpu(), reference), "weights changed across sleep"
        sleep_floor, wake_floor = weight_bytes / (d2h * 1e9), weight_bytes / (h2d * 1e9)
        for what, seconds, floor in (
            ("sleep", sleep_s, sleep_floor if level == 1 else None),
            ("wake", wake_s, wake_floor),
        ):
            gbps = weight_bytes / seconds / 1e9
            frac = (floor / seconds) if floor else None
            rows.append([f"level {level} {what}", seconds, gbps, frac if frac is not None else "-"])
            report[f"level{level}_{what}_s_{len(rows)}"] = seconds
        rows.append([f"  (freed by level {level} sleep, GiB)", freed / 2**30, "", ""])
    naive_cpu = timed(lambda: model.to("cpu"))
    naive_gpu = timed(lambda: model.to(device))
    rows.append(
        ["naive module.to('cpu')", naive_cpu, weight_bytes / naive_cpu / 1e9, weight_bytes / (d2h * 1e9) / naive_cpu]
    )
    rows.append(
        ["naive module.to('cuda')", naive_gpu, weight_bytes / naive_gpu / 1e9, weight_bytes / (h2d * 1e9) / naive_gpu]
    )
    report["rows"] = [[str(c) for c in r] for r in rows]
    print(f"weights {weight_bytes / 1e9:.2f} GB bf16; pinned H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s")
    print_table(["operation", "seconds", "GB/s", "fraction of pinned bandwidth"], rows, floatfmt=".3f")
    print(f"wrote {write_json(args.output, 'sleep_wake', report)}")
    os.remove(ckpt)


if __name__ == "__main__":
    main()

"""DLO step time against the transfer floor and the diffusers group-offloading peer.

For each image size: the resident step time (whole model on the device), measured pinned H2D
bandwidth, diffusers group offloading (block_level, one block per group, CUDA stream) and
stagemesh DLO (no-AllGather) with 0 and with N resident blocks. Step times are steady-state:
timed forwards follow warm-up ones without a synchronize, as the steps of a long request do.
"start-up" is what the same number of steps costs more when started from an idle device (once
per request: the link's lead over the compute is rebuilt). The floor of a streamed step is
max(resident step, streamed bytes / H2D bandwidth); the ratio says how close a case gets to it.
With N resident blocks and two device slots, the link can fill only the two slots from the start of
the last block of one step to the end of the first streamed block of the next (that window, W(N),
spans the resident blocks' compute R(N) and is measured on the resident model), so the two-slot
bound is floor + max(0, W(N) - bytes of the first two streamed blocks / H2D bandwidth). "store GB/s"
is one pass over a DLO case's own host store, copied as the engine copies it: whether that
case's buffers reach the bandwidth the floor assumes. "link idle" is the host link's idle time
per DLO step, from marks around every slot fill on the copy stream in a pass of its own, with
the widest gap (with the index, among the streamed blocks, of the fill that ended it) and the
median/slowest fill rate. "cosine" compares a case's step output with the resident model's.
With --stream-dtype float8_e4m3fn int8 every DLO case runs again for each 8-bit form, and
bench/dlo_quant.py reports their figures against their targets (exit status 1 on a GPU run where
no 8-bit form meets them all).
Weights are random, identical in every build (bench/dlo_models.py), so outputs are compared to
the resident model's too. Every case frees its model before the next one starts.

Run on a GPU:   python -m bench.dlo --preset flux        (diffusers FluxTransformer2DModel)
                python -m bench.dlo                      (the FLUX-sized embedded DiT)
                python -m bench.dlo --preset flux --resident-blocks 0 --stream-dtype float8_e4m3fn int8
Check on a CPU: python -m bench.dlo --preset tiny-flux --device cpu
                python -m bench.dlo --preset tiny --device cpu
Plot:           python -m bench.plot_dlo bench/results/dlo.json --output docs/img/dlo.png
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from torch import nn

from bench import dlo_models as models
from bench import dlo_quant
from bench.common import add_output, add_preset, print_table, write_json
from bench.dlo_timing import (
    h2d_bandwidth,
    link_timeline,
    slot_window_times,
    start_up_time,
    step_time,
    store_bandwidth,
)
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.offload import discover, quant

LEFTOVER_WARN_BYTES = 256 << 20
PRESETS = ("flux-sized", "tiny", "flux", "tiny-flux")  # the embedded DiT, diffusers' FLUX transformer


# ---- measurement -----------------------------------------------------------------------------
def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        # torch's pinned host cache keeps a finished case's pinned copies (the peer's) otherwise.
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()
        torch.cuda.reset_peak_memory_stats(device)


def _allocated(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _peak(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def _pinned_by_torch(device: torch.device) -> int | None:
    """Bytes held by torch's pinned host allocator (rounded blocks), where torch reports it."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except (AttributeError, RuntimeError):
        return None


def _model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _block_bytes(bm: models.BenchModel) -> list[int]:
    return [_model_bytes(b.module) for b in discover(bm.build_meta(), bm.plan).blocks]


def _first_streamed_bytes(bm: models.BenchModel, resident: int, count: int = 2) -> int:
    """Bytes of the first `count` blocks DLO streams with `resident` blocks kept (what the link
    can move into the two slots before a streamed block frees one)."""
    found = discover(bm.build_meta(), bm.plan)
    kept = {b.path for b in found.resident_candidates()[:resident]}
    sizes = [_model_bytes(b.module) for b in found.blocks if b.path not in kept]
    return sum(sizes[:count])


# ---- cases -----------------------------------------------------------------------------------
def _timed(bm, model, device, args, size: int) -> tuple[float, torch.Tensor]:
    _free(device)
    inputs = bm.make_inputs(size, args.text_tokens, device)
    return step_time(bm, model, inputs, device, args.steps, args.warmup)


def _row(
    case: str,
    size: int,
    seconds: float,
    out: torch.Tensor,
    ref: dict,
    streamed: int,
    bandwidth: float,
    device: torch.device,
    **extra,
) -> dict:
    floor = max(ref["step_s"], streamed / bandwidth)
    cosine = torch.nn.functional.cosine_similarity(out.flatten().double(), ref["output"].flatten().double(), dim=0)
    return {
        "case": case,
        "size": size,
        "step_s": seconds,
        "resident_step_s": ref["step_s"],
        "floor_s": floor,
        "ratio": seconds / floor,
        "streamed_bytes": streamed,
        "peak_device_bytes": _peak(device),
        "max_abs_diff": float((out - ref["output"]).abs().max()),
        "cosine": float(cosine),
        **extra,
    }


def _two_slot_bound(row: dict, times: dict[str, float] | None, first_two_bytes: int, bandwidth: float) -> dict:
    """The row with the two-slot bound: the floor plus the part of the slot window (see
    slot_window_times) the link cannot fill, since two slots hold only two blocks."""
    if times is None:
        return {
            **row,
            "resident_compute_s": None,
            "slot_window_s": None,
            "two_slot_bound_s": None,
            "ratio_to_two_slot_bound": None,
        }
    bound = row["floor_s"] + max(0.0, times["window_s"] - first_two_bytes / bandwidth)
    return {
        **row,
        "resident_compute_s": times["resident_s"],
        "slot_window_s": times["window_s"],
        "two_slot_bound_s": bound,
        "ratio_to_two_slot_bound": row["step_s"] / bound,
    }


def _left_behind(device: torch.device, baseline: int, case: str) -> int:
    """Device bytes a finished case still holds (should be none: nothing keeps its weights)."""
    _free(device)
    left = _allocated(device) - baseline
    if left > LEFTOVER_WARN_BYTES:
        print(f"warning: {case} left {left / 1e9:.2f} GB allocated on the device", flush=True)
    return left


def run_resident(bm, device, args, baseline: int) -> dict[int, dict]:
    model = models.build_resident(bm, device)
    weights = _model_bytes(model)
    out = {}
    for size in args.sizes:
        seconds, result = _timed(bm, model, device, args, size)
        out[size] = {
            "step_s": seconds,
            "output": result,
            "weights_bytes": weights,
            "peak_device_bytes": _peak(device),
            "activation_bytes": max(0, _peak(device) - weights),
        }
        inputs = bm.make_inputs(size, args.text_tokens, device)
        out[size]["slot_windows"] = slot_window_times(
            bm, model, inputs, device, args.resident_blocks, args.steps, args.warmup
        )
        del inputs
    del model
    left = _left_behind(device, baseline, "resident")
    for v in out.values():
        v["device_bytes_left"] = left
    return out


def run_group_offload(bm, device, args, reference, bandwidth: float, baseline: int) -> list[dict]:
    """diffusers' group offloading: block_level, one block per group, with a CUDA stream."""
    try:
        import accelerate  # noqa: F401 - group offloading moves its inputs with it
        from diffusers.hooks import apply_group_offloading
    except ImportError as exc:
        print(f"diffusers group offloading skipped: {exc}", flush=True)
        return []
    pinned_before = _pinned_by_torch(device)
    model = models.build_host(bm, device)
    model_bytes = _model_bytes(model)
    streamed = sum(_block_bytes(bm))
    use_stream = device.type == "cuda"  # diffusers refuses streams on a CPU onload device
    options = {
        "onload_device": device,
        "offload_device": torch.device("cpu"),
        "offload_type": "block_level",
        "num_blocks_per_group": 1,
        "use_stream": use_stream,
    }
    if hasattr(model, "enable_group_offload"):
        model.enable_group_offload(**options)
    else:
        apply_group_offloading(model, **options)
    rows = []
    for size in args.sizes:
        seconds, result = _timed(bm, model, device, args, size)
        pinned = _pinned_by_torch(device)
        host = None if pinned is None else pinned - (pinned_before or 0)
        rows.append(
            _row(
                "diffusers group offload",
                size,
                seconds,
                result,
                reference[size],
                streamed,
                bandwidth,
                device,
                resident_blocks=0,
                host_bytes=host,
                host_over_model=None if host is None else host / model_bytes,
                use_stream=use_stream,
            )
        )
    del model
    left = _left_behind(device, baseline, "diffusers group offload")
    return [{**r, "device_bytes_left": left} for r in rows]


def run_dlo(
    bm, device, args, resident: int, reference, bandwidth: float, baseline: int, stream_dtype: str = ""
) -> list[dict]:
    model, engine = models.build_offloaded(bm, device, resident, stream_dtype=quant.stream_dtype(stream_dtype))
    stats = engine.stats()
    model_bytes = _model_bytes(model)
    rest = model_bytes - stats.payload_bytes  # non-block weights and resident blocks
    first_two = _first_streamed_bytes(bm, resident)
    rows = []
    for size in args.sizes:
        seconds, result = _timed(bm, model, device, args, size)
        inputs = bm.make_inputs(size, args.text_tokens, device)
        link = link_timeline(engine, bm, model, inputs, device, args.steps, args.warmup)
        start_up = start_up_time(bm, model, inputs, device, args.steps, seconds)
        ref = reference[size]
        row = _row(
            f"stagemesh DLO {stream_dtype}" if stream_dtype else "stagemesh DLO",
            size,
            seconds,
            result,
            ref,
            stats.h2d_bytes_per_iteration,
            bandwidth,
            device,
            resident_blocks=stats.resident_blocks,
            stream_dtype=stats.stream_dtype,
            host_bytes=stats.host_bytes,
            host_over_model=stats.host_bytes / model_bytes,
            peak_bound_bytes=rest + stats.slot_bytes + ref["activation_bytes"],
            start_up_s=start_up,
            **link,
        )
        times = ref["slot_windows"].get(resident) if stats.resident_blocks else None
        rows.append(_two_slot_bound(row, times, first_two, bandwidth))
    own = store_bandwidth(engine, device)
    engine.close()
    engine.store.close()  # unpins the host buffers now, not whenever the collector gets to it
    del model, engine
    left = _left_behind(device, baseline, f"DLO {stream_dtype or 'as stored'} {resident} resident")
    return [{**r, "device_bytes_left": left, "store_h2d_bytes_per_s": own} for r in rows]


# ---- report ----------------------------------------------------------------------------------
def _resident_rows(reference: dict[int, dict], model_bytes: int) -> list[dict]:
    return [
        {
            "case": "resident",
            "size": size,
            "step_s": ref["step_s"],
            "resident_step_s": ref["step_s"],
            "floor_s": None,
            "ratio": None,
            "streamed_bytes": 0,
            "resident_blocks": None,
            "peak_device_bytes": ref["peak_device_bytes"],
            "host_bytes": 0,
            "host_over_model": 0.0,
            "max_abs_diff": 0.0,
            "cosine": 1.0,
            "weights_bytes": model_bytes,
            "device_bytes_left": ref["device_bytes_left"],
        }
        for size, ref in reference.items()
    ]


def _fmt(value, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _table(rows: list[dict]) -> None:
    gb = 1e-9
    print_table(
        [
            "case",
            "size",
            "resident blocks",
            "step ms",
            "floor ms",
            "ratio",
            "2-slot bound ms",
            "ratio/2-slot",
            "start-up ms",
            "store GB/s",
            "link idle ms",
            "widest gap ms (block)",
            "fill GB/s med/min",
            "streamed GB",
            "peak dev GB",
            "bound GB",
            "pinned/model",
            "max |diff|",
            "cosine",
        ],
        [
            [
                r["case"],
                r["size"],
                "-" if r.get("resident_blocks") is None else r["resident_blocks"],
                _fmt(r["step_s"], 1e3, 1),
                _fmt(r["floor_s"], 1e3, 1),
                _fmt(r["ratio"]),
                _fmt(r.get("two_slot_bound_s"), 1e3, 1),
                _fmt(r.get("ratio_to_two_slot_bound")),
                _fmt(r.get("start_up_s"), 1e3, 1),
                _fmt(r.get("store_h2d_bytes_per_s"), gb, 1),
                _fmt(r.get("link_idle_s"), 1e3, 1),
                "-"
                if r.get("widest_gap_s") is None
                else f"{r['widest_gap_s'] * 1e3:.1f} ({r['widest_gap_before_block']})",
                "-"
                if r.get("fill_rate_median") is None
                else f"{r['fill_rate_median'] * gb:.1f}/{r['fill_rate_min'] * gb:.1f}",
                _fmt(r["streamed_bytes"], gb, 2),
                _fmt(r["peak_device_bytes"], gb, 2),
                _fmt(r.get("peak_bound_bytes"), gb, 2),
                _fmt(r.get("host_over_model")),
                _fmt(r["max_abs_diff"], 1.0, 4),
                _fmt(r.get("cosine"), 1.0, 5),
            ]
            for r in sorted(rows, key=lambda r: r["size"])
        ],
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "flux-sized", "--model", "--tiny-flux")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="image sizes in pixels (default: 512 1024; small models: 128 256)",
    )
    parser.add_argument("--resident-blocks", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="timed denoising steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true", help="skip diffusers group offloading")
    parser.add_argument(
        "--stream-dtype",
        nargs="*",
        choices=[d for d in quant.STREAM_DTYPES if d],
        default=[],
        help="8-bit forms (float8_e4m3fn, int8) to run every DLO case with too, each reported against "
        "the 8-bit targets (default: the model's dtype only)",
    )
    add_output(parser, "dlo", "--json")
    return parser


def _bench_model(args) -> models.BenchModel:
    if args.preset in ("flux", "tiny-flux"):
        # bf16 as on the GPU; float32 for the CPU check (CPU bf16 kernels are slow, not wrong).
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        return models.flux_model(tiny=args.preset == "tiny-flux", dtype=dtype)
    config = PipelineConfig.flux_sized() if args.preset == "flux-sized" else models.TINY_DIT
    return models.dit_model(config)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    small = args.preset.startswith("tiny")
    args.sizes = args.sizes or ([128, 256] if small else [512, 1024])
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    bm = _bench_model(args)
    blocks = _block_bytes(bm)
    bandwidth = h2d_bandwidth(max(blocks), device)
    print(
        f"{bm.name}: {len(blocks)} blocks; H2D {bandwidth / 1e9:.1f} GB/s (pinned, the "
        "largest block per copy, best of 3 runs of 10)",
        flush=True,
    )
    _free(device)
    baseline = _allocated(device)
    reference = run_resident(bm, device, args, baseline)
    model_bytes = next(iter(reference.values()))["weights_bytes"]
    rows = _resident_rows(reference, model_bytes)
    if not args.no_peer:
        rows += run_group_offload(bm, device, args, reference, bandwidth, baseline)
    for resident in args.resident_blocks:
        rows += run_dlo(bm, device, args, resident, reference, bandwidth, baseline)
        for dtype in args.stream_dtype:
            rows += run_dlo(bm, device, args, resident, reference, bandwidth, baseline, dtype)
    _table(rows)
    summary = dlo_quant.report(rows, bandwidth, device.type == "cuda") if args.stream_dtype else None
    path = write_json(
        args.output,
        "dlo",
        {
            "model": bm.name,
            "device": str(device),
            "dtype": str(bm.dtype).removeprefix("torch."),
            "params": sum(p.numel() for p in bm.build_meta().parameters()),
            "model_bytes": model_bytes,
            "blocks": len(blocks),
            "h2d_bytes_per_s": bandwidth,
            "text_tokens": args.text_tokens,
            "steps": args.steps,
            "warmup": args.warmup,
            "stream_dtype": args.stream_dtype,
            "rows": rows,
            "eight_bit": summary,
        },
    )
    print(f"wrote {path}")
    if summary is not None and not any(m is not False for m in summary["met"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""What LoRA adapters cost on a FLUX-shaped transformer: the step time with one adapter against
none, resident and under DLO; the time to switch adapters between requests; the time to load one.

The transformer is diffusers' FluxTransformer2DModel at FLUX.1-dev's shape (11.9 B parameters,
bf16, random weights generated on the device: bench/dlo_models.py), built in memory, not written
to disk. Adapters are random-weight LoRA files in diffusers' layout on every attention projection
(to_q, to_k, to_v, to_out.0 and the context stream's add_q/k/v_proj, to_add_out: 266 layers on
FLUX), at ranks 16 and 32 (--ranks), written to a temporary lora_dir and handled by the stage's own
code (stage_service/models/adapters: read through FluxPipeline.lora_state_dict, added with
load_lora_adapter, switched with set_adapters / disable_lora), so the figures are the stage's.

Per mode (resident: the whole transformer on the device; dlo: blocks streamed from host memory
through two slots, no resident block, as a `enable_dlo` stage runs it):
  step ms       one transformer forward (one denoising step, 1024x1024: 4096 image tokens +
                512 text tokens), p50 over --repeats, for: no adapter loaded ("base"), adapters
                loaded but the request names none ("off"), one adapter of each rank ("rank N")
  load ms       reading and checking the file (on a thread beside the batches in a stage) and
                adding its layers (between two batches), per rank
  switch ms     the adapter set changing between two requests (set_adapters), both adapters on
                the device; and with max_device_adapters = 1, where the switch also moves the
                new adapter's weights host -> device and the old one's back

Run on a GPU (about 3 minutes, no disk beyond a few hundred MB of adapter files):
  python -m bench.lora --device cuda
CPU smoke:
  python -m bench.lora --preset tiny-flux --device cpu --size 64 --tokens 16 --repeats 2 --warmup 1
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common, dlo_models
from stagemesh.core.params import AdapterChoice
from stagemesh.stage_service.models.adapters import AdapterRegistry
from stagemesh.stage_service.models.adapters.synthetic import target_layers, write_random_lora

MODES = ("resident", "dlo")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(run, device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    run()
    _sync(device)
    return (time.perf_counter() - started) * 1e3


def _steps(bm, model, inputs, device, args) -> dict:
    with torch.inference_mode():
        for _ in range(args.warmup):
            bm.forward(model, inputs)
        return common.summarize([_ms(lambda: bm.forward(model, inputs), device) for _ in range(args.repeats)])


def build(bm, mode: str, device: torch.device):
    if mode == "resident":
        return dlo_models.build_resident(bm, device), None
    return dlo_models.build_offloaded(bm, device, resident=0)


def run_mode(bm, mode: str, device: torch.device, args, lora_dir: Path) -> dict:
    import diffusers

    print(f"-- {mode}: building the transformer", flush=True)
    model, engine = build(bm, mode, device)
    inputs = bm.make_inputs(args.size, args.tokens, device)
    ranks = args.ranks
    for rank in ranks:  # the same files for both modes
        path = lora_dir / f"r{rank}.safetensors"
        if not path.exists():
            write_random_lora(path, model, rank=rank, seed=rank, dtype=bm.dtype)
    # The pipeline class converts the files as a stage's pipe does (lora_state_dict is a classmethod).
    registry = AdapterRegistry(diffusers.FluxPipeline, model, device, lora_dir=str(lora_dir))
    out: dict = {"layers": len(target_layers(model)), "step_ms": {}, "load_ms": {}, "bytes": {}}
    out["step_ms"]["base"] = _steps(bm, model, inputs, device, args)
    for rank in ranks:
        name = f"r{rank}"
        prepared = registry.prepare(name, f"{name}.safetensors")
        attach_ms = _ms(lambda prepared=prepared, attach=registry.attach: attach(prepared), device)
        out["load_ms"][name] = {"read": prepared.read_s * 1e3, "attach": attach_ms}
        out["bytes"][name] = next(i.bytes for i in registry.infos() if i.name == name)
    registry.apply(())
    out["step_ms"]["off"] = _steps(bm, model, inputs, device, args)
    for rank in ranks:
        registry.apply((AdapterChoice(f"r{rank}", 1.0),))
        out["step_ms"][f"rank {rank}"] = _steps(bm, model, inputs, device, args)
    out["switch_ms"] = switch_times(registry, ranks, device, args)
    if engine is not None:
        engine.close()
    del model, engine, registry, inputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def switch_times(registry: AdapterRegistry, ranks: list[int], device: torch.device, args) -> dict:
    """The set changing between requests, alternating between two adapters."""
    names = [f"r{r}" for r in ranks] if len(ranks) > 1 else [f"r{ranks[0]}", None]
    sets = [(AdapterChoice(n, 1.0),) if n else () for n in names]
    out = {}
    for bound, label in ((0, "on device"), (1, "moved from host")):
        registry.max_device_adapters = bound
        times = [_ms(lambda i=i: registry.apply(sets[i % 2]), device) for i in range(2 * args.repeats + 1)]
        out[label] = common.summarize(times[1:])  # the first settles the placement
    registry.max_device_adapters = 0
    return out


def report(results: dict, args) -> None:
    rows = []
    for mode, r in results.items():
        base = r["step_ms"]["base"]["p50"]
        for case, s in r["step_ms"].items():
            rows.append((mode, case, s["p50"], s["p50"] / base))
    common.print_table(["mode", "adapters", "step p50 ms", "x base"], rows)
    rows = [
        (mode, name, r["bytes"][name] / 2**20, t["read"], t["attach"])
        for mode, r in results.items()
        for name, t in r["load_ms"].items()
    ]
    common.print_table(["mode", "adapter", "MiB", "read ms", "attach ms"], rows)
    rows = [(mode, label, s["p50"], s["max"]) for mode, r in results.items() for label, s in r["switch_ms"].items()]
    common.print_table(["mode", "switch", "p50 ms", "max ms"], rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    common.add_preset(p, ("flux", "tiny-flux"), "flux", "--tiny")
    p.add_argument("--size", type=int, default=1024, help="image width and height in pixels (default: 1024)")
    p.add_argument("--tokens", type=int, default=512, help="text tokens (default: 512, FLUX.1-dev's)")
    p.add_argument(
        "--ranks", default="16,32", help="LoRA ranks of the adapters, on every attention projection (default: 16,32)"
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    common.add_repeats(p, 5, "timed passes per figure (default: 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each step figure (default: 2)")
    common.add_output(p, None)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.ranks = [int(r) for r in args.ranks.split(",")]
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    if unknown:
        p.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    tiny = args.preset == "tiny-flux"
    bm = dlo_models.flux_model(tiny=tiny, dtype=torch.float32 if tiny else torch.bfloat16)
    results = {}
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        for mode in args.modes.split(","):
            results[mode] = run_mode(bm, mode, device, args, Path(tmp))
            print(f"{mode}: base step p50 {results[mode]['step_ms']['base']['p50']:.1f} ms", flush=True)
    report(results, args)
    out = args.output or common.RESULTS_DIR / ("lora-tiny.json" if tiny else "lora.json")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    common.write_json(out, "lora", {"settings": settings, "results": results})
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

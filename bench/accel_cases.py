"""The compiled, FP8 and step-cache cases of bench/real_pipeline.py (its docstring lists them).

Mesh cases start `stagemesh up` with the diffusion stage's compile / compute_dtype / fp8_backend
keys and a fresh compile cache under the run's work folder, time launch -> ready and the first
image (which compiles: the cold start), the steady images, then stop and start the same mesh
again on the now warm cache and time launch -> ready and its first image (the restart). The
compiled bf16 mesh also serves the step-cache variants, chosen per request (params.step_cache at
the methods' published defaults), each timed and compared (PSNR) with its own uncached image.

`fp8-cosine` loads the transformer alone in this process and compares one pass of fixed random
inputs in bf16 with the same pass through each FP8 back end (eager: the numbers the compiled
graph computes, without its compile time).
"""

from __future__ import annotations

import copy
import functools
import time
from pathlib import Path
from typing import Any

import torch

from bench import common
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import start_mesh

PROMPT = "a lighthouse at dusk"
# case -> the diffusion stage's extra mesh.toml keys
MESH_CASES = {
    "mesh-compiled": 'compile = "regional"\n',
    "mesh-compiled-fp8": 'compile = "regional"\ncompute_dtype = "float8"\nfp8_backend = "scaled_mm"\n',
    "mesh-compiled-fp8-torchao": 'compile = "regional"\ncompute_dtype = "float8"\nfp8_backend = "torchao"\n',
}
PEER_CASES = ("diffusers-compiled", "diffusers-torchao-fp8")
STEP_CACHES = ("first_block", "taylorseer", "mag")  # served by mesh-compiled, per request
CASES = (*PEER_CASES, *MESH_CASES, "fp8-cosine")
EAGER_REFERENCES = ("diffusers-resident", "mesh-resident")  # what PSNR compares with, first found


def _params(args, **extra: Any) -> gateway_pb2.GenerateUnaryRequest:
    params = generation_pb2.GenerationParams(
        prompt=PROMPT,
        width=args.size,
        height=args.size,
        num_inference_steps=args.steps,
        guidance_scale=3.5,
        seed=args.seed,
        **extra,
    )
    return gateway_pb2.GenerateUnaryRequest(params=params)


def _start(config: Path, log: Path, folder: Path):
    started = time.perf_counter()
    mesh = start_mesh(config, log, ("--model", str(folder)), timeout_s=1800)
    return mesh, time.perf_counter() - started


def _call(stub, request) -> None:
    stub.GenerateUnary(request, timeout=3600)


def _first_image(stub, request) -> tuple[bytes, float]:
    started = time.perf_counter()
    png = stub.GenerateUnary(request, timeout=3600).result.png
    return png, (time.perf_counter() - started) * 1e3


def mesh_case(name: str, folder: Path, device: torch.device, args, work: Path, write_config) -> dict:
    """One accelerated mesh, cold then restarted warm; `write_config(path, extra_keys)` writes its mesh.toml."""
    config = write_config(work / f"{name}.toml", MESH_CASES[name])
    out: dict[str, Any] = {}
    mesh, out["cold_launch_to_ready_s"] = _start(config, work / f"{name}.log", folder)
    try:
        with mesh.channel() as channel:
            stub = mesh.gateway(channel)
            request = _params(args)
            out["png"], out["cold_first_image_ms"] = _first_image(stub, request)
            out["latency_ms"] = common.summarize(common.timed_ms(functools.partial(_call, stub, request), args.repeats))
            if name == "mesh-compiled":
                out["step_cache"] = _step_cache_variants(stub, args)
    finally:
        mesh.stop(timeout=300)
    mesh, out["warm_launch_to_ready_s"] = _start(config, work / f"{name}-restart.log", folder)
    try:
        with mesh.channel() as channel:
            png, out["warm_first_image_ms"] = _first_image(mesh.gateway(channel), _params(args))
            out["restart_same_png"] = png == out["png"]
    finally:
        mesh.stop(timeout=300)
    return out


def _step_cache_variants(stub, args) -> dict[str, dict]:
    out = {}
    for method in STEP_CACHES:
        request = _params(args, step_cache=method)
        result = stub.GenerateUnary(request, timeout=3600).result  # the first: the hooks go on
        times = common.timed_ms(functools.partial(_call, stub, request), args.repeats)
        out[method] = {
            "latency_ms": common.summarize(times),
            "skipped": result.step_cache_skipped,
            "passes": result.step_cache_passes,
            "png": result.png,
        }
    return out


def diffusers_case(name: str, folder: Path, device: torch.device, args) -> dict:
    """The peers: diffusers' pipeline with regional compile, bf16 or torchao FP8 (PerRow)."""
    import diffusers

    from stagemesh.gateway.images import encode_png
    from stagemesh.stage_service.models.diffusers_adapter.loading import dtype_kwarg

    started = time.perf_counter()
    pipe = diffusers.FluxPipeline.from_pretrained(folder, local_files_only=True, **dtype_kwarg(args.dtype))
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    if name == "diffusers-torchao-fp8":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        quantize_(pipe.transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    pipe.transformer.compile_repeated_blocks(fullgraph=True)
    loaded_s = time.perf_counter() - started

    def run() -> bytes:
        image = pipe(
            prompt=PROMPT,
            width=args.size,
            height=args.size,
            num_inference_steps=args.steps,
            guidance_scale=3.5,
            output_type="pt",
            generator=torch.Generator().manual_seed(args.seed),
        ).images[0]
        return encode_png(image.permute(1, 2, 0).float().cpu().numpy())

    png, first_ms = _first_image_local(run)
    out = {"png": png, "load_s": loaded_s, "cold_first_image_ms": first_ms}
    out["latency_ms"] = common.summarize(common.timed_ms(run, args.repeats))
    return out


def _first_image_local(run) -> tuple[bytes, float]:
    started = time.perf_counter()
    png = run()
    return png, (time.perf_counter() - started) * 1e3


def fp8_cosine(folder: Path, device: torch.device, args) -> dict:
    """Per-pass cosine of each FP8 back end against bf16, same weights, same random inputs."""
    from diffusers import FluxTransformer2DModel

    from stagemesh.stage_service.models.acceleration import fp8
    from stagemesh.stage_service.models.diffusers_adapter.loading import dtype_kwarg

    model = FluxTransformer2DModel.from_pretrained(folder / "transformer", **dtype_kwarg(args.dtype))
    model = model.to(device).eval().requires_grad_(False)
    inputs = _pass_inputs(model, args, device)
    with torch.inference_mode():
        reference = model(**inputs, return_dict=False)[0].float()
    out: dict[str, Any] = {}
    host = copy.deepcopy(model.to("cpu"))  # each back end converts its own copy
    del model
    for backend in ("scaled_mm", "torchao"):
        candidate = copy.deepcopy(host).to(device)
        try:
            layers = fp8.convert(candidate, backend)
        except RuntimeError as exc:  # torchao missing
            out[backend] = {"error": str(exc)}
            continue
        with torch.inference_mode():
            got = candidate(**inputs, return_dict=False)[0].float()
        out[backend] = {"cosine": fp8.cosine(got, reference), "layers": layers}
        print(f"per-pass cosine vs bf16, FP8 {backend} ({layers} layers): {out[backend]['cosine']:.4f}", flush=True)
        del candidate, got
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return out


def _pass_inputs(model, args, device: torch.device) -> dict[str, torch.Tensor]:
    """One FLUX transformer call's inputs at the run's size, random but fixed."""
    g = torch.Generator().manual_seed(args.seed)
    cfg = model.config
    tokens = (args.size // 16) ** 2
    dtype = args.dtype

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    ids = torch.zeros(args.size // 16, args.size // 16, 3)
    ids[..., 1] += torch.arange(args.size // 16)[:, None]
    ids[..., 2] += torch.arange(args.size // 16)[None, :]
    out = {
        "hidden_states": rand(1, tokens, cfg.in_channels),
        "encoder_hidden_states": rand(1, 512, cfg.joint_attention_dim),
        "pooled_projections": rand(1, cfg.pooled_projection_dim),
        "timestep": torch.tensor([0.5], device=device, dtype=dtype),
        "img_ids": ids.reshape(-1, 3).to(device=device, dtype=dtype),
        "txt_ids": torch.zeros(512, 3, device=device, dtype=dtype),
    }
    if cfg.guidance_embeds:
        out["guidance"] = torch.tensor([3.5], device=device, dtype=torch.float32)
    return out


def run(name: str, folder: Path, device: torch.device, args, work: Path, write_config) -> dict:
    if name in MESH_CASES:
        return mesh_case(name, folder, device, args, work, write_config)
    if name in PEER_CASES:
        return diffusers_case(name, folder, device, args)
    return fp8_cosine(folder, device, args)


def report(results: dict, pngs: dict[str, bytes], args, psnr) -> dict:
    """Speed against diffusers' eager pipeline and PSNR against the eager image, for each case
    this module ran; the restart figures; the step-cache variants against their uncached image."""
    eager = next((case for case in EAGER_REFERENCES if case in results), None)
    base = results["diffusers-resident"]["latency_ms"]["p50"] if "diffusers-resident" in results else None
    rows, out = [], {}
    for case in (*PEER_CASES, *MESH_CASES):
        if case not in results:
            continue
        r = results[case]
        p50 = r["latency_ms"]["p50"]
        entry = {
            "vs_diffusers_eager": p50 / base if base else None,
            "psnr_vs_eager_db": psnr(pngs[case], pngs[eager]) if eager else None,
        }
        out[case] = entry
        speed = f"{entry['vs_diffusers_eager']:.3f}" if base else "-"
        quality = f"{entry['psnr_vs_eager_db']:.2f}" if eager else "-"
        rows.append((case, f"{p50:.1f}", speed, quality, f"{r.get('cold_first_image_ms', 0) / 1e3:.1f}"))
    if rows:
        print(f"accelerated cases ({args.steps} steps, {args.size}x{args.size}; PSNR vs {eager})", flush=True)
        common.print_table(["case", "p50 ms", "x diffusers eager", "PSNR dB", "first image s"], rows)
    out["restart"] = _restart_report(results)
    out["step_cache"] = _step_cache_report(results, pngs, psnr)
    if "fp8-cosine" in results:
        out["fp8_cosine"] = {k: v.get("cosine") for k, v in results["fp8-cosine"].items()}
    return out


def _restart_report(results: dict) -> dict:
    rows, out = [], {}
    uncompiled = results.get("mesh-resident", {})
    plain = uncompiled.get("launch_to_ready_s")
    for case in MESH_CASES:
        r = results.get(case)
        if r is None:
            continue
        out[case] = {k: r[k] for k in r if k.startswith(("cold_", "warm_")) or k == "restart_same_png"}
        warm = r["warm_launch_to_ready_s"] + r["warm_first_image_ms"] / 1e3
        cold = r["cold_launch_to_ready_s"] + r["cold_first_image_ms"] / 1e3
        baseline = plain + uncompiled["first_image_ms"] / 1e3 if plain is not None else None
        rows.append((case, f"{cold:.1f}", f"{warm:.1f}", f"{baseline:.1f}" if baseline else "-"))
    if rows:
        print("launch -> first image, s (cold: empty compile cache; warm: restart on it; uncompiled: mesh-resident)")
        common.print_table(["case", "cold", "warm", "uncompiled"], rows)
    return out


def _step_cache_report(results: dict, pngs: dict[str, bytes], psnr) -> dict:
    r = results.get("mesh-compiled")
    if not r or "step_cache" not in r:
        return {}
    rows, out = [], {}
    uncached = r["latency_ms"]["p50"]
    for method, v in r["step_cache"].items():
        png = v.pop("png")
        out[method] = {
            "speedup": uncached / v["latency_ms"]["p50"],
            "psnr_vs_uncached_db": psnr(png, pngs["mesh-compiled"]),
            "skipped": v["skipped"],
            "passes": v["passes"],
        }
        speedup, quality = out[method]["speedup"], out[method]["psnr_vs_uncached_db"]
        rows.append((method, f"{speedup:.2f}", f"{quality:.2f}", v["skipped"], v["passes"]))
    print("step caches on mesh-compiled at the published default thresholds (random weights: speed only)")
    common.print_table(["method", "speed-up", "PSNR dB vs uncached", "skipped", "passes"], rows)
    return out

"""End-to-end latency per image of a diffusers-format FLUX pipeline: through the mesh
(`stagemesh up --model`) against diffusers' own pipeline in one process.

Cases, one after the other in one run (each frees the GPU before the next starts):
  diffusers-resident   FluxPipeline.from_pretrained(...).to(device)
  mesh-resident        encoder stage + diffusion stage, both on the device
  diffusers-group      the transformer under diffusers group offloading (block_level, one block
                       per group, use_stream=True); text encoders and VAE on the device
  mesh-dlo             the diffusion stage streams the transformer's blocks (DLO, no-AllGather,
                       blocks mapped straight from the checkpoint)
  mesh-dlo-fp8         as mesh-dlo, the blocks' Linear weights streamed in FP8
                       (dlo_stream_dtype = "float8_e4m3fn", docs/DLO.md)
  mesh-dlo-int8        as mesh-dlo, streamed in int8 (dlo_stream_dtype = "int8")
  diffusers-compiled   diffusers-resident with transformer.compile_repeated_blocks(fullgraph=True)
  diffusers-torchao-fp8  as diffusers-compiled after torchao's quantize_ with
                       Float8DynamicActivationFloat8WeightConfig(PerRow) (the FP8 peer; slow to compile)
  mesh-compiled        mesh-resident with compile = "regional": cold start (empty compile cache), its
                       steady images, the step caches (first_block, taylorseer, mag at their published
                       defaults, chosen per request), then a restart on the warm compile cache
  mesh-compiled-fp8    as mesh-compiled with compute_dtype = "float8", fp8_backend = "scaled_mm"
  mesh-compiled-fp8-torchao  the same with fp8_backend = "torchao"
  fp8-cosine           one transformer pass, bf16 against each FP8 back end (eager), per-pass cosine
The mesh cases above mesh-compiled run with compile = "off": the eager figures stay eager.
Targets: mesh-resident <= 1.05 x diffusers-resident; mesh-dlo faster than diffusers-group.
Fidelity of 8-bit streaming: the PSNR of mesh-dlo-fp8's and mesh-dlo-int8's final images against
the image of the model's own dtype (mesh-dlo's, else mesh-resident's, else
diffusers-resident's), printed.
Latency is request to PNG bytes on both sides (the diffusers peer encodes its PNG the same way).

The checkpoint: FLUX.1-dev's transformer shape (diffusers' default FluxTransformer2DModel config
with guidance embeddings, 11.9 B parameters) with random, non-zero weights generated on the
device tensor by tensor (bench/dlo_models.py), FLUX.1's VAE layout, and small text encoders of
the widths the transformer expects; bf16, written once with save_pretrained (about 24 GB).

Run on a GPU:  python -m bench.real_pipeline --device cuda
Issue 30's figures (compile, FP8, step caching, restart on a warm compile cache), two runs on one
folder, each under 10 minutes on an H200 (docs/PERFORMANCE.md, "Compiled denoising"):
  python -m bench.real_pipeline --device cuda --folder /tmp/flux --repeats 2 --warmup 0 \
    --cases diffusers-resident,diffusers-compiled,mesh-resident,mesh-compiled
  python -m bench.real_pipeline --device cuda --folder /tmp/flux --repeats 2 --warmup 0 \
    --cases diffusers-resident,mesh-resident,mesh-compiled-fp8,fp8-cosine
8-bit fidelity:
  python -m bench.real_pipeline --device cuda --repeats 1 --warmup 0 --cases mesh-dlo,mesh-dlo-fp8,mesh-dlo-int8
CPU smoke:     python -m bench.real_pipeline --preset tiny-flux --device cpu --steps 2 --size 32
"""

from __future__ import annotations

import argparse
import functools
import io
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench import accel_cases, common
from stagemesh.gateway.images import encode_png
from stagemesh.stage_service.models.diffusers_adapter import synthetic
from stagemesh.stage_service.models.diffusers_adapter.loading import dtype_kwarg
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import start_mesh

PROMPT = "a lighthouse at dusk"
CASES = (
    "diffusers-resident",
    "mesh-resident",
    "diffusers-group",
    "mesh-dlo",
    "mesh-dlo-fp8",
    "mesh-dlo-int8",
    *accel_cases.CASES,
)
EIGHT_BIT = {"mesh-dlo-fp8": "float8_e4m3fn", "mesh-dlo-int8": "int8"}  # case -> dlo_stream_dtype
# What an 8-bit case's image is compared with, in order of preference (all the model's dtype).
REFERENCES = ("mesh-dlo", "mesh-resident", "diffusers-resident")


# ---- the checkpoint ----------------------------------------------------------------------------
def write_folder(folder: Path, tiny: bool, device: torch.device) -> Path:
    if (folder / "model_index.json").is_file():
        print(f"using the checkpoint in {folder}", flush=True)
        return folder
    started = time.perf_counter()
    torch.manual_seed(0)
    if tiny:
        synthetic.write_tiny(folder, "flux")
    else:
        from bench import dlo_models

        bm = dlo_models.flux_model(tiny=False, dtype=torch.bfloat16)
        transformer = bm.build_meta()
        # Generated on the device (fast), kept on the host: the folder is written from there.
        dlo_models.materialize(transformer, "", device, torch.device("cpu"))
        cfg = transformer.config
        components = synthetic.flux_components(
            transformer,
            vae_config=synthetic.FLUX_VAE,
            text_dim=cfg.joint_attention_dim,
            pooled_dim=cfg.pooled_projection_dim,
        )
        synthetic.write_pipeline(folder, "FluxPipeline", components, torch.bfloat16)
    print(f"wrote {folder} in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


# ---- measurement -------------------------------------------------------------------------------
def diffusers_case(folder: Path, device: torch.device, args, group: bool) -> dict:
    import diffusers

    pipe = diffusers.FluxPipeline.from_pretrained(folder, local_files_only=True, **dtype_kwarg(args.dtype))
    pipe.set_progress_bar_config(disable=True)
    if group:
        pipe.transformer.enable_group_offload(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=device.type == "cuda",
        )  # streams need a CUDA device (the --tiny check)
        for name in ("text_encoder", "text_encoder_2", "vae"):
            getattr(pipe, name).to(device)
    else:
        pipe.to(device)

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

    png = run()
    times = common.timed_ms(run, args.repeats, args.warmup)
    return {"latency_ms": common.summarize(times), "png_bytes": len(png), "png": png}


def _mesh_config(path: Path, device: str, dlo: bool, stream_dtype: str = "", extra: str = 'compile = "off"\n') -> Path:
    stream = f'dlo_stream_dtype = "{stream_dtype}"\n' if stream_dtype else ""
    dlo_keys = "enable_dlo = true\ndlo_use_allgather = false\n" + stream if dlo else ""
    dlo_keys += extra
    # CPU check: one thread per process, as the in-process peer (main), so neither oversubscribes.
    threads = "threads = 1\n" if device == "cpu" else ""
    path.write_text(f"""[gateway]
port = 0

[cache]
root = "{path.parent / "cache"}"

[supervision]
ready_timeout_s = 1800.0

[[stages]]
kind = "encoder"
device = "{device}"
max_size = 2048
{threads}
[[stages]]
kind = "diffusion"
device = "{device}"
max_batch_size = 1
max_size = 2048
{threads}{dlo_keys}""")
    return path


def _accel_config(path: Path, keys: str, device: str) -> Path:
    return _mesh_config(path, device, dlo=False, extra=keys)


def mesh_case(folder: Path, device: torch.device, args, name: str, work: Path) -> dict:
    dlo = name.startswith("mesh-dlo")
    config = _mesh_config(work / f"{name}.toml", str(device), dlo, EIGHT_BIT.get(name, ""))
    started = time.perf_counter()
    mesh = start_mesh(config, work / f"{name}.log", ("--model", str(folder)), timeout_s=1800)
    launch_to_ready_s = time.perf_counter() - started
    params = generation_pb2.GenerationParams(
        prompt=PROMPT,
        width=args.size,
        height=args.size,
        num_inference_steps=args.steps,
        guidance_scale=3.5,
        seed=args.seed,
    )
    request = gateway_pb2.GenerateUnaryRequest(params=params)
    try:
        with mesh.channel() as channel:
            stub = mesh.gateway(channel)

            def run() -> bytes:
                return stub.GenerateUnary(request, timeout=3600).result.png

            started = time.perf_counter()
            png = run()
            first_image_ms = (time.perf_counter() - started) * 1e3
            times = common.timed_ms(run, args.repeats, args.warmup)
    finally:
        code = mesh.stop(timeout=300)
    if code != 0:
        raise RuntimeError(f"{name}: `stagemesh up` exited {code}; log:\n{mesh.logs()[-3000:]}")
    return {
        "latency_ms": common.summarize(times),
        "png_bytes": len(png),
        "png": png,
        "launch_to_ready_s": launch_to_ready_s,
        "first_image_ms": first_image_ms,
    }


# ---- report ------------------------------------------------------------------------------------
def psnr(a: bytes, b: bytes) -> float:
    """PSNR in dB of two 8-bit PNG images (inf when identical)."""
    x, y = (np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64) for png in (a, b))
    if x.shape != y.shape:
        raise ValueError(f"images differ in size: {x.shape} vs {y.shape}")
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def eight_bit_fidelity(pngs: dict[str, bytes], args) -> dict[str, dict]:
    """Each 8-bit case's final image against the same request's image in the model's dtype."""
    reference = next((case for case in REFERENCES if case in pngs), None)
    out = {}
    for case in EIGHT_BIT:
        if case not in pngs or reference is None:
            continue
        value = psnr(pngs[case], pngs[reference])
        print(
            f"PSNR {case} vs {reference}: {value:.2f} dB ({args.steps} steps, {args.size}x{args.size}, "
            f"seed {args.seed}; final PNG images)",
            flush=True,
        )
        out[case] = {"psnr_db": value, "reference": reference}
    return out


def report(results: dict, args) -> dict:
    p50 = {case: r["latency_ms"]["p50"] for case, r in results.items()}
    rows = [
        (case, p50[case], results[case]["latency_ms"]["mean"], results[case]["latency_ms"]["min"]) for case in results
    ]
    common.print_table(["case", "p50 ms", "mean ms", "min ms"], rows, ".1f")
    ratios = {}
    if {"mesh-resident", "diffusers-resident"} <= p50.keys():
        ratios["mesh_vs_diffusers_resident"] = p50["mesh-resident"] / p50["diffusers-resident"]
    if {"mesh-dlo", "diffusers-group"} <= p50.keys():
        ratios["mesh_dlo_vs_diffusers_group"] = p50["mesh-dlo"] / p50["diffusers-group"]
    for case in EIGHT_BIT:
        if {case, "mesh-dlo"} <= p50.keys():
            key = f"{case.replace('-', '_')}_vs_mesh_dlo"
            ratios[key] = p50[case] / p50["mesh-dlo"]
            print(f"{case} / mesh-dlo latency: {ratios[key]:.3f}", flush=True)
    targets = {"mesh_vs_diffusers_resident": 1.05, "mesh_dlo_vs_diffusers_group": 1.0}
    for key, value in ratios.items():
        if key not in targets:
            continue  # a figure, not a target
        verdict = "meets" if value <= targets[key] else "misses"
        print(f"{key}: {value:.3f} ({verdict} the target <= {targets[key]})", flush=True)
    pngs = {case: r.pop("png") for case, r in results.items()}
    same = {
        f"{a} == {b}": pngs[a] == pngs[b]
        for a, b in (
            ("mesh-resident", "diffusers-resident"),
            ("mesh-dlo", "diffusers-group"),
            ("mesh-dlo", "mesh-resident"),
        )
        if a in pngs and b in pngs
    }
    for key, value in same.items():
        print(f"PNG bytes {key}: {value}", flush=True)
    fidelity = eight_bit_fidelity(pngs, args)
    accelerated = accel_cases.report(results, pngs, args, psnr)
    return {
        "ratios": ratios,
        "targets": targets,
        "same_png": same,
        "eight_bit_fidelity": fidelity,
        "accelerated": accelerated,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # flux: FLUX.1-dev's transformer in a pipeline, bf16; tiny-flux: a tiny FLUX-style pipeline, float32
    common.add_preset(p, ("flux", "tiny-flux"), "flux", "--tiny")
    common.add_model_dir(
        p,
        "the checkpoint, written there when it holds none; default: a temporary folder, removed afterwards",
        "--folder",
    )
    p.add_argument("--size", type=int, default=1024, help="width and height (default: 1024)")
    p.add_argument("--steps", type=int, default=28, help="denoising steps (default: 28)")
    common.add_repeats(p, 3, "timed images per case (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed images per case after the first (default: 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    common.add_output(p, None, "--out")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.tiny = args.preset == "tiny-flux"
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    unknown = sorted(set(args.cases.split(",")) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the mesh's stages get (see _mesh_config)
    with tempfile.TemporaryDirectory(prefix="real-pipeline-") as tmp:
        work = Path(tmp)
        folder = write_folder(Path(args.model_dir) if args.model_dir else work / "flux", args.tiny, device)
        results = {}
        cosine = None
        for case in args.cases.split(","):
            print(f"-- {case}", flush=True)
            if case == "fp8-cosine":
                cosine = accel_cases.fp8_cosine(folder, device, args)
                common.free_device(device)
                continue
            if case in accel_cases.CASES:
                config = functools.partial(_accel_config, device=str(device))
                results[case] = accel_cases.run(case, folder, device, args, work, config)
                common.free_device(device)
            elif case.startswith("mesh"):
                results[case] = mesh_case(folder, device, args, case, work)
            else:
                results[case] = diffusers_case(folder, device, args, case == "diffusers-group")
                common.free_device(device)  # the pipeline went with the call's frame
            # Each case as it ends: a run cut short still reports what it measured.
            print(f"{case}: p50 {results[case]['latency_ms']['p50']:.1f} ms", flush=True)
        summary = report(results, args)
        if cosine is not None:
            summary["fp8_cosine"] = cosine
    out = args.output or common.RESULTS_DIR / ("real_pipeline-tiny.json" if args.tiny else "real_pipeline.json")
    settings = {k: (str(v) if isinstance(v, (Path, torch.dtype)) else v) for k, v in vars(args).items()}
    common.write_json(out, "real_pipeline", {"settings": settings, "results": results, **summary})
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

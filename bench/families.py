"""Each model family end to end: its full-shape transformer (random weights, bf16, at the family's
native resolution) through the mesh against diffusers' own pipeline loaded from the same folder.

Per family, one after the other (each case frees the GPU before the next starts, and the
family's folder is deleted after its run, so the disk holds one family at a time):
  diffusers-resident   DiffusionPipeline.from_pretrained(folder).to(device)
  mesh-resident        `stagemesh up --model folder`: encoder stage + diffusion stage
  diffusers-group      the transformer under diffusers group offloading (block_level, one block
                       per group, CUDA stream); the rest of the pipeline on the device
  mesh-dlo             the diffusion stage streams the transformer's blocks (DLO, no-AllGather)
  mesh-dlo-fp8         as mesh-dlo, blocks streamed in FP8 (dlo_stream_dtype)
  mesh-dlo-int8        as mesh-dlo, streamed in int8
Printed per family: p50 latency per image of each case, whether mesh-resident's PNG bytes equal
diffusers-resident's (and mesh-dlo's diffusers-group's), mesh-resident / diffusers-resident
(target <= 1.01), mesh-dlo against its transfer floor (target <= 1.03) and against
diffusers-group (target < 1), and the 8-bit cases' PSNR against mesh-dlo's image.

Transfer floor of a request under DLO: max(mesh-resident latency, transformer passes x streamed
block bytes / measured pinned H2D bandwidth), passes = steps x (2 when the family's guidance calls
the transformer a second time for the unconditional half; Z-Image and SD3 batch it into one
call). It is a lower bound: the text encoding and the VAE decode, which do not overlap the
stream, are counted only through the resident latency.

The folders: `stagemesh synthesize --size full` layouts (the published transformer and VAE
dimensions; random weights drawn on the device), with text encoders cut to --text-layers layers
of their published width (the transformer is what is timed; FLUX.2 [klein] keeps 28, since it
reads layer 27). Native resolution and guidance per family are in FAMILIES below.

Run on a GPU (one family per command keeps each under the 10-minute limit):
  python -m bench.families --families zimage --steps 8
  python -m bench.families --families flux2-klein --steps 4
Qwen-Image (43 GB folder) in two commands over one kept folder, deleted afterwards:
  python -m bench.families --families qwen-image --steps 4 --repeats 1 --warmup 0 \
      --model-dir /tmp/fam --cases diffusers-resident,mesh-resident,mesh-dlo
  python -m bench.families --families qwen-image --steps 4 --repeats 1 --warmup 0 \
      --model-dir /tmp/fam --cases diffusers-group,mesh-dlo,mesh-dlo-fp8 && rm -rf /tmp/fam
Qwen-Image-Edit (the same 43 GB transformer; each request edits a fixed 1024² gradient):
  python -m bench.families --families qwen-image-edit --steps 2 --repeats 1 --warmup 0
CPU smoke (tiny folders, 32 px, 2 steps):
  python -m bench.families --preset tiny-folders --device cpu --families zimage,qwen-image \
      --cases diffusers-resident,mesh-resident,mesh-dlo,mesh-dlo-int8
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common
from bench.real_pipeline import EIGHT_BIT, _mesh_config, psnr
from stagemesh.gateway.images import encode_png
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import start_mesh

PROMPT = "a lighthouse at dusk"
CASES = ("diffusers-resident", "mesh-resident", "diffusers-group", "mesh-dlo", "mesh-dlo-fp8", "mesh-dlo-int8")
# family -> (native size, guidance_scale, negative prompt, a separate unconditional transformer
# call per step: Qwen-Image calls the transformer twice a step; Z-Image and SD3 batch the two
# halves into one call, so each step streams the blocks once)
FAMILIES: dict[str, tuple[int, float, str, bool]] = {
    "zimage": (1024, 1.0, "", False),  # guidance >= 1 always runs Z-Image's CFG (batched)
    "qwen-image": (1328, 4.0, "blurry", True),  # true CFG with a negative prompt, two calls
    "qwen-image-edit": (1024, 4.0, "blurry", True),  # as qwen-image, editing a 1024² picture
    "flux2-klein": (1024, 1.0, "", False),  # the distilled 4B: no CFG
    "flux": (1024, 3.5, "", False),  # guidance distilled into an embedding
    "sd3": (1024, 5.0, "", False),  # CFG batched
}
TARGETS = {"mesh_vs_diffusers_resident": 1.01, "mesh_dlo_vs_floor": 1.03, "mesh_dlo_vs_diffusers_group": 1.0}


# ---- the folder --------------------------------------------------------------------------------
def write_folder(folder: Path, family: str, args) -> Path:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.full import write_full

    started = time.perf_counter()
    if args.preset == "tiny-folders":
        write_tiny(folder, family)
    else:
        where = "cuda" if args.device.startswith("cuda") else "cpu"
        write_full(folder, family, torch.bfloat16, text_layers=args.text_layers, report=print, device=where)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"wrote {folder} ({size / 2**30:.1f} GiB) in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def streamed_bytes(folder: Path) -> int:
    """Bytes of the transformer's blocks (what DLO streams per pass with no resident block)."""
    from stagemesh.stage_service.models.diffusers_adapter import open_folder
    from stagemesh.stage_service.models.diffusers_adapter.families import family_of
    from stagemesh.weight_store.checkpoint import read_index

    checkpoint = open_folder(folder)
    prefixes = tuple(f"{attr}." for attr in family_of(checkpoint).block_attrs)
    return sum(
        record.nbytes
        for file in checkpoint.weight_files("transformer")
        for key, record in read_index(file).items()
        if key.startswith(prefixes)
    )


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Pinned host -> device bytes per second (None off CUDA)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 5 * nbytes / (time.perf_counter() - started)


# ---- cases -------------------------------------------------------------------------------------
def _request(family: str, args) -> tuple[int, float, str]:
    size, guidance, negative, _ = FAMILIES[family]
    return (args.size or (32 if args.preset == "tiny-folders" else size)), guidance, negative


def edit_picture(size: int) -> bytes:
    """The picture an edit family's requests edit: a fixed gradient, PNG."""
    ramp = torch.linspace(0, 1, size)
    picture = torch.stack([ramp.expand(size, size), ramp.expand(size, size).T, 1 - ramp.expand(size, size)], dim=-1)
    return encode_png(picture.numpy())


def load_diffusers(folder: Path, args):
    """diffusers' own pipeline from the folder, with the components the family builds itself
    (a processor transformers cannot build without torchvision) handed over as the stages do."""
    import diffusers

    from stagemesh.stage_service.models.diffusers_adapter import open_folder
    from stagemesh.stage_service.models.diffusers_adapter.families import family_of

    family = family_of(open_folder(folder))
    built = family.built_components(folder) if family.built_components else {}
    pipe = diffusers.DiffusionPipeline.from_pretrained(
        folder, local_files_only=True, **{name: None for name in built}, **_dtype(args)
    )
    for name, component in built.items():
        setattr(pipe, name, component)
    return pipe


def pipeline_call(family: str, args) -> dict:
    """The keywords of the peer's pipeline call for one request (the generator aside)."""
    import PIL.Image

    size, guidance, negative = _request(family, args)
    keyword = "true_cfg_scale" if family.startswith("qwen-image") else "guidance_scale"
    call: dict = {"prompt": PROMPT, "width": size, "height": size, "num_inference_steps": args.steps}
    call.update({"output_type": "pt", keyword: guidance})
    if negative:
        call["negative_prompt"] = negative
    if family == "qwen-image-edit":
        call["image"] = PIL.Image.open(io.BytesIO(edit_picture(size))).convert("RGB")
    return call


def diffusers_case(folder: Path, family: str, device: torch.device, args, group: bool) -> dict:
    pipe = load_diffusers(folder, args)
    pipe.set_progress_bar_config(disable=True)
    if group:
        pipe.transformer.enable_group_offload(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=device.type == "cuda",
        )
        for name, component in pipe.components.items():
            if isinstance(component, torch.nn.Module) and name != "transformer":
                component.to(device)
    else:
        pipe.to(device)
    call = pipeline_call(family, args)

    def run() -> bytes:
        image = pipe(**call, generator=torch.Generator().manual_seed(args.seed)).images[0]
        return encode_png(image.permute(1, 2, 0).float().cpu().numpy())

    png = run()
    times = common.timed_ms(run, args.repeats, args.warmup)
    return {"latency_ms": common.summarize(times), "png": png}


def mesh_request(family: str, args) -> gateway_pb2.GenerateUnaryRequest:
    """The mesh's request for what pipeline_call asks of the peer."""
    size, guidance, negative = _request(family, args)
    params = generation_pb2.GenerationParams(
        prompt=PROMPT,
        negative_prompt=negative,
        width=size,
        height=size,
        num_inference_steps=args.steps,
        guidance_scale=guidance,
        seed=args.seed,
        init_image=edit_picture(size) if family == "qwen-image-edit" else b"",
    )
    return gateway_pb2.GenerateUnaryRequest(params=params)


def mesh_case(folder: Path, family: str, device: torch.device, args, name: str, work: Path) -> dict:
    dlo = name.startswith("mesh-dlo")
    config = _mesh_config(work / f"{family}-{name}.toml", str(device), dlo, EIGHT_BIT.get(name, ""))
    mesh = start_mesh(config, work / f"{family}-{name}.log", ("--model", str(folder)), timeout_s=1800)
    request = mesh_request(family, args)
    try:
        with mesh.channel() as channel:
            stub = mesh.gateway(channel)

            def run() -> bytes:
                return stub.GenerateUnary(request, timeout=3600).result.png

            png = run()
            times = common.timed_ms(run, args.repeats, args.warmup)
    finally:
        code = mesh.stop(timeout=300)
    if code != 0:
        raise RuntimeError(f"{family} {name}: `stagemesh up` exited {code}; log:\n{mesh.logs()[-3000:]}")
    return {"latency_ms": common.summarize(times), "png": png}


def _dtype(args) -> dict:
    from stagemesh.stage_service.models.diffusers_adapter.loading import dtype_kwarg

    return dtype_kwarg(torch.float32 if args.preset == "tiny-folders" else torch.bfloat16)


# ---- report ------------------------------------------------------------------------------------
def report(family: str, results: dict, args, streamed: int, bandwidth: float | None) -> dict:
    p50 = {case: r["latency_ms"]["p50"] for case, r in results.items()}
    common.print_table(["case", "p50 ms", "min ms"], [(c, p50[c], results[c]["latency_ms"]["min"]) for c in p50], ".1f")
    ratios: dict[str, float] = {}
    if {"mesh-resident", "diffusers-resident"} <= p50.keys():
        ratios["mesh_vs_diffusers_resident"] = p50["mesh-resident"] / p50["diffusers-resident"]
    if {"mesh-dlo", "diffusers-group"} <= p50.keys():
        ratios["mesh_dlo_vs_diffusers_group"] = p50["mesh-dlo"] / p50["diffusers-group"]
    floor_ms = None
    if bandwidth and {"mesh-dlo", "mesh-resident"} <= p50.keys():
        passes = args.steps * (2 if FAMILIES[family][3] else 1)
        floor_ms = max(p50["mesh-resident"], passes * streamed / bandwidth * 1e3)
        ratios["mesh_dlo_vs_floor"] = p50["mesh-dlo"] / floor_ms
    for key, value in ratios.items():
        verdict = "meets" if value <= TARGETS[key] else "misses"
        print(f"{family} {key}: {value:.3f} ({verdict} the target <= {TARGETS[key]})", flush=True)
    pngs = {case: r.pop("png") for case, r in results.items()}
    same = {
        f"{a} == {b}": pngs[a] == pngs[b]
        for a, b in (("mesh-resident", "diffusers-resident"), ("mesh-dlo", "diffusers-group"))
        if a in pngs and b in pngs
    }
    for key, value in same.items():
        print(f"{family} PNG bytes {key}: {value}", flush=True)
    fidelity = {}
    for case in EIGHT_BIT:
        if {case, "mesh-dlo"} <= pngs.keys():
            fidelity[case] = psnr(pngs[case], pngs["mesh-dlo"])
            print(f"{family} PSNR {case} vs mesh-dlo: {fidelity[case]:.2f} dB", flush=True)
    return {
        "ratios": ratios,
        "same_png": same,
        "psnr_db": fidelity,
        "floor_ms": floor_ms,
        "streamed_bytes": streamed,
        "h2d_bytes_per_s": bandwidth,
        "size": _request(family, args)[0],
    }


def run_family(family: str, device: torch.device, args, work: Path) -> dict:
    print(f"== {family}", flush=True)
    kept = args.model_dir is not None
    folder = (Path(args.model_dir) if kept else work) / family
    try:
        if (folder / "model_index.json").is_file():
            print(f"using the folder in {folder}", flush=True)
        else:
            write_folder(folder, family, args)
        streamed = streamed_bytes(folder)
        bandwidth = h2d_bandwidth(device)
        results = {}
        for case in args.cases.split(","):
            print(f"-- {family} {case}", flush=True)
            if case.startswith("mesh"):
                results[case] = mesh_case(folder, family, device, args, case, work)
            else:
                results[case] = diffusers_case(folder, family, device, args, case == "diffusers-group")
                common.free_device(device)
            print(f"{family} {case}: p50 {results[case]['latency_ms']['p50']:.1f} ms", flush=True)
        return {"results": results, **report(family, results, args, streamed, bandwidth)}
    finally:
        if not kept:
            shutil.rmtree(folder, ignore_errors=True)  # the disk holds one family at a time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    common.add_preset(p, ("published", "tiny-folders"), "published")
    common.add_model_dir(
        p,
        "FAMILY/ under it is written when absent and kept after the run, to split one family's "
        "cases over several commands; default: a temporary folder per family, deleted after its run",
    )
    p.add_argument("--families", default="zimage", help=f"comma-separated subset of {', '.join(FAMILIES)}")
    p.add_argument("--size", type=int, default=None, help="width and height (default: the family's native size)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps (default: 8)")
    p.add_argument("--text-layers", type=int, default=2, help="layers kept of each text encoder (default: 2)")
    common.add_repeats(p, 2, "timed images per case (default: 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed images per case after the first (default: 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    common.add_output(p, None)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for option, given, known in (("--cases", args.cases, CASES), ("--families", args.families, tuple(FAMILIES))):
        unknown = sorted(set(given.split(",")) - set(known))
        if unknown:
            p.error(f"{option}: unknown {unknown}; known: {', '.join(known)}")
    if args.preset == "tiny-folders":
        args.steps = min(args.steps, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the mesh's stages get
    summary = {}
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        for family in args.families.split(","):
            summary[family] = run_family(family, device, args, Path(tmp))
    out = args.output or common.RESULTS_DIR / (
        "families-tiny.json" if args.preset == "tiny-folders" else "families.json"
    )
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    common.write_json(out, "families", {"settings": settings, "families": json.loads(json.dumps(summary))})
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

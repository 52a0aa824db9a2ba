"""Wan 2.2 text-to-video, request to MP4, through the mesh (`stagemesh up --model`) against
diffusers' WanPipeline in one process, with the transformer resident, under DLO and under 8-bit
streaming.

Cases, one after the other in one run (each frees the GPU before the next starts):
  diffusers-resident   WanPipeline.from_pretrained(...).to(device)
  mesh-resident        encoder stage + diffusion stage, both on the device
  diffusers-group      the transformer under diffusers group offloading (block_level, one block
                       per group, use_stream=True); text encoder and VAE on the device
  mesh-dlo             the diffusion stage streams the transformer's blocks (DLO, no-AllGather,
                       blocks mapped straight from the checkpoint)
  mesh-dlo-fp8         as mesh-dlo, the blocks' Linear weights streamed in FP8
  mesh-dlo-int8        as mesh-dlo, streamed in int8
Targets (issue 29): mesh-resident <= 1.01 x diffusers-resident with identical frames;
mesh-dlo ahead of diffusers-group. Fidelity of 8-bit streaming: the PSNR of the 8-bit cases'
frames against mesh-dlo's (else mesh-resident's), printed.

Latency is request to MP4 bytes on both sides (the diffusers peer encodes its frames with the
gateway's own encoder, H.264 at quality 90). Identity is checked on the raw frames: each case's
first, untimed request asks for the float32 frames (the mesh's tensor output, streamed in
chunks), whose bytes are hashed and compared.

The checkpoint (preset wan-5b): Wan 2.2 TI2V-5B's transformer shape (WanTransformer3DModel,
dim 3072 = 24 heads x 128, 30 blocks, ffn 14336, 48 latent channels, 5.0 B parameters) with
random weights generated on the device tensor by tensor (bench/dlo_models.py), the 5B's VAE
layout (Wan 2.2's residual VAE: 48 latent channels, 16x spatial, 4x temporal, patch 2) with
random weights, a small UMT5 of the 4096 width the transformer takes, expand_timesteps as the 5B
pipeline; bf16, written once with save_pretrained (about 11 GB, in a temporary folder removed at
the end unless --model-dir names one). One expert, so no boundary_ratio. A video: 17 frames at
832x480 (5 latent frames of 26 x 15 patches: 1950 tokens), 10 steps, guidance 5.0. Each case's
first video (the raw frames) is untimed and warms it up.

Run on a GPU (estimated 5-7 minutes, most of it loading: 11 GB of disk, deleted afterwards):
  python -m bench.video --device cuda
In two runs of under 5 minutes each, the checkpoint kept between them (then removed):
  python -m bench.video --device cuda --model-dir /tmp/wan5b --cases diffusers-resident,mesh-resident
  python -m bench.video --device cuda --model-dir /tmp/wan5b --cases diffusers-group,mesh-dlo,mesh-dlo-int8
  rm -rf /tmp/wan5b
CPU smoke (the same layout, tiny):
  python -m bench.video --preset tiny-wan --device cpu --size 64x64 --frames 5 --steps 2 --repeats 1
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench import common
from stagemesh.client import Client
from stagemesh.gateway.videos import encode_video
from stagemesh.stage_service.models.diffusers_adapter.loading import dtype_kwarg, import_diffusers
from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_pipeline
from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux_sd3 import t5_tokenizer
from tests.support.meshproc import start_mesh

PROMPT = "a fox running through fresh snow"
GUIDANCE = 5.0
CASES = ("diffusers-resident", "mesh-resident", "diffusers-group", "mesh-dlo", "mesh-dlo-fp8", "mesh-dlo-int8")
EIGHT_BIT = {"mesh-dlo-fp8": "float8_e4m3fn", "mesh-dlo-int8": "int8"}  # case -> dlo_stream_dtype
REFERENCES = ("mesh-dlo", "mesh-resident", "diffusers-resident")  # what 8-bit frames are compared with
PRESETS = {
    "wan-5b": "Wan 2.2 TI2V-5B's transformer and VAE layout, bf16 (about 11 GB)",
    "tiny-wan": "the same layout with tiny widths, float32 (a CPU check)",
}
# WanTransformer3DModel: TI2V-5B's config, and the tiny one of the same structure.
TRANSFORMER = {
    "wan-5b": {"num_attention_heads": 24, "attention_head_dim": 128, "ffn_dim": 14336, "num_layers": 30},
    "tiny-wan": {"num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64, "num_layers": 2},
}
TEXT_DIM = {"wan-5b": 4096, "tiny-wan": 32}
# AutoencoderKLWan: Wan 2.2's residual VAE (z 48, 16x16 spatial with its 2x2 patching), and tiny.
VAE = {
    "wan-5b": {"base_dim": 160, "decoder_base_dim": 256, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2},
    "tiny-wan": {"base_dim": 8, "decoder_base_dim": 8, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1},
}
Z_DIM = 48


# ---- the checkpoint ----------------------------------------------------------------------------
def _transformer(preset: str, dtype: torch.dtype, device: torch.device):
    from bench import dlo_models

    d = import_diffusers()
    config = {
        **TRANSFORMER[preset],
        "patch_size": (1, 2, 2),
        "in_channels": Z_DIM,
        "out_channels": Z_DIM,
        "text_dim": TEXT_DIM[preset],
        "freq_dim": 256,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
    }
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = d.WanTransformer3DModel(**config)
    finally:
        torch.set_default_dtype(saved)
    # The rotary tables are buffers computed at construction: built again, for real, on the host.
    model.rope = type(model.rope)(config["attention_head_dim"], config["patch_size"], model.config.rope_max_seq_len)
    # Generated on the device (fast), kept on the host: the folder is written from there.
    dlo_models.materialize(model, "", device, torch.device("cpu"))
    return model.eval().requires_grad_(False)


def _text_encoder(width: int, vocab_size: int):
    from transformers import UMT5Config, UMT5EncoderModel

    heads = max(1, width // 128)
    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=width,
        d_kv=width // heads,
        d_ff=1024,
        num_layers=2,
        num_heads=heads,
        pad_token_id=0,
        eos_token_id=1,
    )
    return UMT5EncoderModel(config)


def write_folder(folder: Path, preset: str, dtype: torch.dtype, device: torch.device) -> Path:
    if (folder / "model_index.json").is_file():
        print(f"using the checkpoint in {folder}", flush=True)
        return folder
    started = time.perf_counter()
    torch.manual_seed(0)
    d = import_diffusers()
    tokenizer = t5_tokenizer()
    vae = d.AutoencoderKLWan(
        **VAE[preset],
        z_dim=Z_DIM,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.0] * Z_DIM,
        latents_std=[1.0] * Z_DIM,
    )
    components = {
        "tokenizer": tokenizer,
        "text_encoder": _text_encoder(TEXT_DIM[preset], len(tokenizer)),
        "vae": vae,
        "scheduler": d.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0),
        "transformer": _transformer(preset, dtype, device),
        "transformer_2": None,
        "expand_timesteps": True,  # TI2V-5B's per-token timesteps
    }
    write_pipeline(folder, "WanPipeline", components, dtype)
    print(f"wrote {folder} in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


# ---- measurement -------------------------------------------------------------------------------
def _frames_record(frames: np.ndarray) -> dict:
    """The raw frames' hash (identity) and their 8-bit form (fidelity), from float32 frames."""
    frames = np.ascontiguousarray(frames, dtype=np.float32)
    quantised = (frames * np.float32(255.0)).round().clip(0, 255).astype(np.uint8)
    return {"sha256": hashlib.sha256(frames.tobytes()).hexdigest(), "uint8": quantised}


def diffusers_case(folder: Path, device: torch.device, args, group: bool) -> dict:
    d = import_diffusers()
    pipe = d.WanPipeline.from_pretrained(folder, local_files_only=True, **dtype_kwarg(args.dtype))
    pipe.set_progress_bar_config(disable=True)
    if group:
        pipe.transformer.enable_group_offload(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=device.type == "cuda",
        )
        for name in ("text_encoder", "vae"):
            getattr(pipe, name).to(device)
    else:
        pipe.to(device)

    def frames() -> np.ndarray:
        return pipe(
            prompt=PROMPT,
            width=args.width,
            height=args.height,
            num_frames=args.frames,
            num_inference_steps=args.steps,
            guidance_scale=GUIDANCE,
            output_type="np",
            generator=torch.Generator().manual_seed(args.seed),
        ).frames[0]

    record = _frames_record(frames())
    times = common.timed_ms(lambda: encode_video(frames(), "mp4", args.fps, 90), args.repeats, args.warmup)
    return {"latency_ms": common.summarize(times), **record}


def _mesh_config(path: Path, device: str, dlo: bool, stream_dtype: str = "") -> Path:
    stream = f'dlo_stream_dtype = "{stream_dtype}"\n' if stream_dtype else ""
    dlo_keys = "enable_dlo = true\ndlo_use_allgather = false\n" + stream if dlo else ""
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
{threads}
[[stages]]
kind = "diffusion"
device = "{device}"
max_batch_size = 1
max_size = 2048
max_frames = 121
{threads}{dlo_keys}""")
    return path


def mesh_case(folder: Path, device: torch.device, args, name: str, work: Path) -> dict:
    dlo = name.startswith("mesh-dlo")
    config = _mesh_config(work / f"{name}.toml", str(device), dlo, EIGHT_BIT.get(name, ""))
    mesh = start_mesh(config, work / f"{name}.log", ("--model", str(folder)), timeout_s=1800)
    request = {
        "width": args.width,
        "height": args.height,
        "num_frames": args.frames,
        "fps": args.fps,
        "steps": args.steps,
        "guidance_scale": GUIDANCE,
        "seed": args.seed,
        "timeout": 3600,
    }
    try:
        with Client(mesh.address, retries=0) as client:
            record = _frames_record(client.generate_video(PROMPT, output_format="tensor", **request).frames)
            times = common.timed_ms(lambda: client.generate_video(PROMPT, **request).bytes, args.repeats, args.warmup)
    finally:
        code = mesh.stop(timeout=300)
    if code != 0:
        raise RuntimeError(f"{name}: `stagemesh up` exited {code}; log:\n{mesh.logs()[-3000:]}")
    return {"latency_ms": common.summarize(times), **record}


# ---- report ------------------------------------------------------------------------------------
def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def report(results: dict, args) -> dict:
    p50 = {case: r["latency_ms"]["p50"] for case, r in results.items()}
    rows = [(c, p50[c], results[c]["latency_ms"]["mean"], results[c]["latency_ms"]["min"]) for c in results]
    common.print_table(["case", "p50 ms", "mean ms", "min ms"], rows, ".1f")
    ratios = {}
    if {"mesh-resident", "diffusers-resident"} <= p50.keys():
        ratios["mesh_vs_diffusers_resident"] = p50["mesh-resident"] / p50["diffusers-resident"]
    if {"mesh-dlo", "diffusers-group"} <= p50.keys():
        ratios["mesh_dlo_vs_diffusers_group"] = p50["mesh-dlo"] / p50["diffusers-group"]
    if {"mesh-dlo", "mesh-resident"} <= p50.keys():
        ratios["mesh_dlo_vs_mesh_resident"] = p50["mesh-dlo"] / p50["mesh-resident"]
    targets = {"mesh_vs_diffusers_resident": 1.01, "mesh_dlo_vs_diffusers_group": 1.0}
    for key, value in ratios.items():
        verdict = (
            f" ({'meets' if value <= targets[key] else 'misses'} the target <= {targets[key]})"
            if key in targets
            else ""
        )
        print(f"{key}: {value:.3f}{verdict}", flush=True)
    frames = {case: r.pop("uint8") for case, r in results.items()}
    pairs = (
        ("mesh-resident", "diffusers-resident"),
        ("mesh-dlo", "mesh-resident"),
        ("diffusers-group", "diffusers-resident"),
    )
    same = {
        f"{a} == {b}": results[a]["sha256"] == results[b]["sha256"] for a, b in pairs if a in results and b in results
    }
    for key, value in same.items():
        print(f"float32 frames {key}: {value}", flush=True)
    fidelity = {}
    reference = next((case for case in REFERENCES if case in frames), None)
    for case in EIGHT_BIT:
        if case in frames and reference is not None:
            value = psnr(frames[case], frames[reference])
            print(f"PSNR {case} vs {reference}: {value:.2f} dB (8-bit frames, {args.frames} frames)", flush=True)
            fidelity[case] = {"psnr_db": value, "reference": reference}
    return {"ratios": ratios, "targets": targets, "same_frames": same, "eight_bit_fidelity": fidelity}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    listed = "; ".join(f"{name}: {what}" for name, what in PRESETS.items())
    p.add_argument("--preset", choices=sorted(PRESETS), default="wan-5b", help=f"the model: {listed} (default: wan-5b)")
    common.add_model_dir(
        p, "the checkpoint, written there when it holds none; default: a temporary folder, removed afterwards"
    )
    p.add_argument("--size", default="832x480", help="WIDTHxHEIGHT, multiples of 32 (default: 832x480)")
    p.add_argument("--frames", type=int, default=17, help="frames, 4k + 1 (default: 17)")
    p.add_argument("--fps", type=int, default=24, help="the MP4's frame rate (default: 24, TI2V-5B's)")
    p.add_argument("--steps", type=int, default=10, help="denoising steps (default: 10)")
    common.add_repeats(p, 2, "timed videos per case (default: 2)")
    p.add_argument("--warmup", type=int, default=0, help="untimed videos per case after the first (default: 0)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    common.add_output(p, None)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.width, args.height = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        p.error(f"--size {args.size!r}: give WIDTHxHEIGHT, e.g. 832x480")
    if (args.frames - 1) % 4:
        p.error(f"--frames {args.frames}: Wan takes 4k + 1 frames (e.g. 17)")
    args.dtype = torch.float32 if args.preset == "tiny-wan" else torch.bfloat16
    unknown = sorted(set(args.cases.split(",")) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the mesh's stages get (see _mesh_config)
    with tempfile.TemporaryDirectory(prefix="video-bench-") as tmp:
        work = Path(tmp)
        folder = Path(args.model_dir) if args.model_dir else work / "wan"
        write_folder(folder, args.preset, args.dtype, device)
        results = {}
        for case in args.cases.split(","):
            print(f"-- {case}", flush=True)
            if case.startswith("mesh"):
                results[case] = mesh_case(folder, device, args, case, work)
            else:
                results[case] = diffusers_case(folder, device, args, case == "diffusers-group")
                common.free_device(device)
            print(f"{case}: p50 {results[case]['latency_ms']['p50']:.1f} ms", flush=True)
        summary = report(results, args)
    out = args.output or common.RESULTS_DIR / f"video-{args.preset}.json"
    settings = {k: (str(v) if isinstance(v, (Path, torch.dtype)) else v) for k, v in vars(args).items()}
    common.write_json(out, "video", {"settings": settings, "results": results, **summary})
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

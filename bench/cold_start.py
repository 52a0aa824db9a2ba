"""Launch to first image: diffusers' own pipeline against `stagemesh up --model FOLDER`, with the
page cache hot and dropped, and where the mesh's start-up time goes.

Cases, one after the other in one run, each a fresh process tree timed from its launch:
  disk-read        read every file of the folder once after dropping the page cache (8 threads,
                   64 MiB reads): the floor of a cold start; with the cache not droppable it
                   is read hot and says so
  diffusers        a fresh Python process: FluxPipeline.from_pretrained(FOLDER).to(device), then
                   two images (the peer), page cache hot
  diffusers-cold   the same after dropping the page cache (not in the default set)
  mesh-hot         `stagemesh up --model FOLDER`, then two images through the gateway
  mesh-cold        the same after dropping the page cache
  mesh-compiled    the stage's compile option with its disk cache: one start on an empty cache
                   (the first start on a fresh node), then one on the warm cache (skipped with a
                   note while the stage has no `compile` option)
Each case reports launch -> ready, the first image, the second image, and launch -> first image.
The mesh's cases also list their start-up phases (docs/OPERATIONS.md, "Start-up phases"), read
from the "startup phase" lines of the mesh's log, as seconds after the launch.
Targets: launch -> first image <= 10 s with page cache and compile cache warm (mesh-compiled's
warm start, else mesh-hot); mesh-cold <= the disk read time + 5 s.

Dropping the page cache (`echo 3 > /proc/sys/vm/drop_caches`) needs root and a writable
/proc/sys; where it is not possible the cold cases are skipped and the JSON says why.

The checkpoint is bench/real_pipeline.py's (FLUX.1-dev-shaped random bf16 weights, about 24 GB,
written once and reused by every case; keep it between runs with --model-dir).

Run on a GPU (about 6 minutes with the folder written in the run, 24 GB of disk):
  python -m bench.cold_start --device cuda --model-dir /tmp/flux-folder
CPU smoke:  python -m bench.cold_start --preset tiny-flux --device cpu --steps 2 --size 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import common

PROMPT = "a lighthouse at dusk"
CASES = ("disk-read", "diffusers", "diffusers-cold", "mesh-hot", "mesh-cold", "mesh-compiled")
DEFAULT_CASES = ("disk-read", "diffusers", "mesh-hot", "mesh-cold", "mesh-compiled")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
READ_THREADS = 8
READ_CHUNK = 64 << 20
TARGET_WARM_FIRST_IMAGE_S = 10.0
TARGET_COLD_OVER_DISK_S = 5.0


# ---- the page cache and the disk -----------------------------------------------------------------
def drop_page_cache() -> str | None:
    """Drop the page cache; None when done, else why it could not be."""
    if os.geteuid() != 0:
        return "not root: dropping the page cache needs root"
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
    except OSError as exc:
        return f"cannot write {DROP_CACHES}: {exc}"
    return None


def folder_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _read_whole(path: Path) -> int:
    buffer = bytearray(READ_CHUNK)
    view, total = memoryview(buffer), 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    return total


def disk_read(folder: Path) -> dict:
    """Seconds to read every file of the folder from disk (page cache dropped first)."""
    why_not = drop_page_cache()
    started = time.perf_counter()
    with ThreadPoolExecutor(READ_THREADS) as pool:
        total = sum(pool.map(_read_whole, folder_files(folder)))
    seconds = time.perf_counter() - started
    return {
        "bytes": total,
        "seconds": seconds,
        "gb_per_s": total / seconds / 1e9 if seconds else 0.0,
        "page_cache": "hot (could not drop: " + why_not + ")" if why_not else "dropped",
    }


# ---- the peer: diffusers in a fresh process -----------------------------------------------------
def peer_main(folder: str, device: str, size: int, steps: int, seed: int) -> None:
    """Run in the child process: load, two images; prints one JSON line of wall-clock instants."""
    import torch

    from stagemesh.gateway.images import encode_png
    from stagemesh.stage_service.models.diffusers_adapter.folder import open_folder
    from stagemesh.stage_service.models.diffusers_adapter.loading import (
        checkpoint_dtype,
        dtype_kwarg,
        import_diffusers,
    )

    if device == "cpu":
        torch.set_num_threads(1)  # as the mesh's stages get (see mesh_config)
    diffusers = import_diffusers()
    kwargs = dtype_kwarg(checkpoint_dtype(open_folder(folder)))
    pipe = diffusers.FluxPipeline.from_pretrained(folder, local_files_only=True, **kwargs).to(device)
    pipe.set_progress_bar_config(disable=True)
    instants = {"ready": time.time()}
    for name in ("first", "second"):
        image = pipe(
            prompt=PROMPT,
            width=size,
            height=size,
            num_inference_steps=steps,
            guidance_scale=3.5,
            output_type="pt",
            generator=torch.Generator().manual_seed(seed),
        ).images[0]
        encode_png(image.permute(1, 2, 0).float().cpu().numpy())
        instants[name] = time.time()
    print("PEER " + json.dumps(instants), flush=True)


def diffusers_case(folder: Path, args) -> dict:
    argv = [sys.executable, "-m", "bench.cold_start", "--peer-run", str(folder), "--device", args.device]
    argv += ["--size", str(args.size), "--steps", str(args.steps), "--seed", str(args.seed)]
    launched = time.time()
    done = subprocess.run(argv, cwd=common.REPO, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PEER ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the diffusers process exited {done.returncode}:\n{done.stderr[-3000:]}")
    instants = json.loads(lines[-1].removeprefix("PEER "))
    return _timeline(launched, instants["ready"], instants["first"], instants["second"])


def _timeline(launched: float, ready: float, first: float, second: float) -> dict:
    return {
        "ready_s": ready - launched,
        "first_image_s": first - ready,
        "second_image_s": second - first,
        "launch_to_first_image_s": first - launched,
    }


# ---- the mesh -----------------------------------------------------------------------------------
def has_compile_option() -> bool:
    from stagemesh.stage_service.settings import StageSettings

    return "compile" in {f.name for f in dataclasses.fields(StageSettings)}


def mesh_config(path: Path, device: str, size: int, cache_root: Path, compiled: bool) -> Path:
    """The encoder and diffusion stages; the served size is the diffusion stage's default, which
    is the size its start-up warm-up runs at. Where the stage has a `compile` option, the
    uncompiled cases turn it off and `compiled` compiles with its cache in `cache_root`."""
    threads = "threads = 1\n" if device == "cpu" else ""
    compile_keys = ""
    if has_compile_option():
        compile_keys = (
            f'compile = "regional"\ndlo_runtime_cache_dir = "{cache_root}"\n' if compiled else 'compile = "off"\n'
        )
    path.write_text(f"""[gateway]
port = 0

[cache]
root = "{cache_root}"

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
default_size = {size}
{threads}{compile_keys}""")
    return path


def startup_phases(log_text: str, launched: float) -> list[dict]:
    """The "startup phase" lines of a mesh's log, each with its start as seconds after launch."""
    phases = []
    for line in log_text.splitlines():
        if '"startup phase"' not in line:
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        phases.append(
            {
                "role": entry.get("role", entry.get("service", "")),
                "phase": entry["phase"],
                "start_s": round(entry["at"] - launched, 3),
                "seconds": entry["seconds"],
            }
        )
    return sorted(phases, key=lambda p: p["start_s"])


def mesh_case(folder: Path, args, name: str, work: Path, cache_root: Path, compiled: bool = False) -> dict:
    from stagemesh.v1 import gateway_pb2, generation_pb2
    from tests.support.meshproc import start_mesh

    config = mesh_config(work / f"{name}.toml", args.device, args.size, cache_root, compiled)
    log_path = work / f"{name}.log"
    params = generation_pb2.GenerationParams(
        prompt=PROMPT,
        width=args.size,
        height=args.size,
        num_inference_steps=args.steps,
        guidance_scale=3.5,
        seed=args.seed,
    )
    request = gateway_pb2.GenerateUnaryRequest(params=params)
    launched = time.time()
    mesh = start_mesh(config, log_path, ("--model", str(folder)), timeout_s=1800)
    ready = time.time()
    try:
        with mesh.channel() as channel:
            stub = mesh.gateway(channel)
            stub.GenerateUnary(request, timeout=3600)
            first = time.time()
            stub.GenerateUnary(request, timeout=3600)
            second = time.time()
    finally:
        code = mesh.stop(timeout=300)
    if code != 0:
        raise RuntimeError(f"{name}: `stagemesh up` exited {code}; log:\n{mesh.logs()[-3000:]}")
    return {**_timeline(launched, ready, first, second), "phases": startup_phases(mesh.logs(), launched)}


# ---- the run ------------------------------------------------------------------------------------
def run_case(case: str, folder: Path, args, work: Path) -> dict:
    if case == "disk-read":
        return disk_read(folder)
    cold = case.endswith("-cold")
    if cold:
        why_not = drop_page_cache()
        if why_not:
            return {"skipped": why_not}
    if case.startswith("diffusers"):
        return diffusers_case(folder, args)
    if case == "mesh-compiled":
        if not has_compile_option():
            return {"skipped": "the stage has no `compile` option in this build"}
        root = work / "compile-cache"
        first = mesh_case(folder, args, "mesh-compile-first", work, root, compiled=True)
        warm = mesh_case(folder, args, "mesh-compiled", work, root, compiled=True)
        return {**warm, "first_start_on_fresh_node": first}
    return mesh_case(folder, args, case, work, work / f"cache-{case}")


def _row(case: str, result: dict) -> list:
    if "skipped" in result:
        return [case, "skipped: " + result["skipped"], "", "", ""]
    return [
        case,
        result["ready_s"],
        result["first_image_s"],
        result["second_image_s"],
        result["launch_to_first_image_s"],
    ]


def verdicts(results: dict) -> dict:
    out = {}
    warm = results.get("mesh-compiled", {})
    warm_case = "mesh-compiled" if "launch_to_first_image_s" in warm else "mesh-hot"
    if "launch_to_first_image_s" in results.get(warm_case, {}):
        value = results[warm_case]["launch_to_first_image_s"]
        out["warm_launch_to_first_image"] = {
            "case": warm_case,
            "seconds": value,
            "target_s": TARGET_WARM_FIRST_IMAGE_S,
            "meets": value <= TARGET_WARM_FIRST_IMAGE_S,
        }
    disk = results.get("disk-read", {})
    cold = results.get("mesh-cold", {})
    if "launch_to_first_image_s" in cold and disk.get("page_cache") == "dropped":
        limit = disk["seconds"] + TARGET_COLD_OVER_DISK_S
        out["cold_launch_to_first_image"] = {
            "seconds": cold["launch_to_first_image_s"],
            "target_s": limit,
            "meets": cold["launch_to_first_image_s"] <= limit,
        }
    return out


def report(results: dict) -> dict:
    rows = [_row(case, r) for case, r in results.items() if case != "disk-read"]
    common.print_table(["case", "ready s", "first image s", "second image s", "launch->first s"], rows, ".2f")
    if "disk-read" in results:
        d = results["disk-read"]
        print(
            f"disk read of the folder: {d['bytes'] / 1e9:.2f} GB in {d['seconds']:.2f} s "
            f"({d['gb_per_s']:.2f} GB/s, page cache {d['page_cache']})",
            flush=True,
        )
    for case, r in results.items():
        if r.get("phases"):
            print(f"-- start-up phases of {case} (seconds after launch)", flush=True)
            phase_rows = [[p["role"], p["phase"], p["start_s"], p["seconds"]] for p in r["phases"]]
            common.print_table(["process", "phase", "start s", "seconds"], phase_rows, ".2f")
    found = verdicts(results)
    for key, v in found.items():
        print(
            f"{key}: {v['seconds']:.2f} s ({'meets' if v['meets'] else 'misses'} the target <= {v['target_s']:.2f} s)",
            flush=True,
        )
    return found


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="torch device of the stages and the peer (default: cuda)")
    common.add_preset(p, ("flux", "tiny-flux"), "flux", "--tiny")
    common.add_model_dir(
        p, "the checkpoint, written there when it holds none; default: a temporary folder, removed afterwards"
    )
    p.add_argument("--size", type=int, default=1024, help="width and height (default: 1024)")
    p.add_argument("--steps", type=int, default=28, help="denoising steps (default: 28)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated subset of {', '.join(CASES)} (default: {','.join(DEFAULT_CASES)})",
    )
    p.add_argument("--peer-run", metavar="FOLDER", help=argparse.SUPPRESS)  # the diffusers case's child
    common.add_output(p, None)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    unknown = sorted(set(args.cases.split(",")) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer_run:
        peer_main(args.peer_run, args.device, args.size, args.steps, args.seed)
        return 0
    import torch

    from bench.real_pipeline import write_folder

    tiny = args.preset == "tiny-flux"
    with tempfile.TemporaryDirectory(prefix="cold-start-") as tmp:
        work = Path(tmp)
        folder = Path(args.model_dir) if args.model_dir else work / "flux"
        write_folder(folder, tiny, torch.device(args.device))
        results: dict[str, dict] = {}
        for case in args.cases.split(","):
            print(f"-- {case}", flush=True)
            results[case] = run_case(case, folder, args, work)
            print(f"{case}: {json.dumps({k: v for k, v in results[case].items() if k != 'phases'})}", flush=True)
        found = report(results)
    out = args.output or common.RESULTS_DIR / ("cold_start-tiny.json" if tiny else "cold_start.json")
    common.write_json(out, "cold_start", {"settings": vars(args), "results": results, "verdicts": found})
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

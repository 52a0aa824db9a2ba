"""Several images from one request: throughput of one GenerateUnary with num_images = N against
N one-image requests sent one after the other, through a real mesh of the embedded model.

Starts `stagemesh up` in a temp dir with the stages' defaults (as `stagemesh up` runs them: torch's
own thread count, max_batch_size 4, batch_invariant on, unless flags say otherwise), then
alternates, `--repeats` times (rounds),

  (a) one request:  GenerateUnary(num_images=N, seed=S)          -> N images;
  (b) N requests:   GenerateUnary(num_images=1, seed=S+i), i < N, one after the other.

Both ask for the same images (image i of (a) has seed S+i); the script checks they are the same
picture and says whether they are also the same bytes (batching may move a value by rounding).
Throughput is N / wall time; the ratio (b) / (a) is the speed-up. Where the time goes: the
gateway's per-stage latency of every image, and, after the mesh has stopped, the diffusion
stage's forward pass alone at batch 1 and batch N (DiffusionRunner.run in this process) - the
ceiling batching can reach on this machine.

    python -m bench.num_images [--images 4] [--size 256] [--steps 8] [--repeats 10]

Target (issue): (a) >= 3x the throughput of (b).
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

from bench import common
from bench.meshes import measured_on_mesh
from stagemesh.core import rpc
from stagemesh.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2

TARGET_RATIO = 3.0
CALL_TIMEOUT_S = 600.0
PROMPT = "a lighthouse at dusk"


def write_mesh_config(path: Path, args: argparse.Namespace) -> Path:
    """The default mesh (ar + diffusion, one worker each) on free ports, with a private cache root."""
    invariant = "true" if args.batch_invariant else "false"
    stage = (
        f'model_dir = "{args.model_dir}"\nthreads = {args.threads}\nmax_batch_size = {args.max_batch_size}\n'
        f'device = "{args.device}"\nbatch_invariant = {invariant}\n'
    )
    path.write_text(
        f'[gateway]\nport = 0\n\n[cache]\nroot = "{path.parent / "cache-root"}"\n\n'
        f'[[stages]]\nkind = "ar"\n{stage}\n[[stages]]\nkind = "diffusion"\n{stage}'
    )
    return path


class Client:
    def __init__(self, address: str, args: argparse.Namespace):
        self.channel = grpc.insecure_channel(address, options=rpc.channel_options())
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        self.args = args

    def params(self, seed: int, images: int) -> generation_pb2.GenerationParams:
        a = self.args
        return generation_pb2.GenerationParams(
            prompt=PROMPT, width=a.size, height=a.size, num_inference_steps=a.steps, seed=seed, num_images=images
        )

    def one_request(self) -> tuple[float, list[generation_pb2.GenerationResult]]:
        t0 = time.perf_counter()
        reply = self.stub.GenerateUnary(
            gateway_pb2.GenerateUnaryRequest(params=self.params(self.args.seed, self.args.images)),
            timeout=CALL_TIMEOUT_S,
        )
        return time.perf_counter() - t0, list(reply.results)

    def sequential(self) -> tuple[float, list[generation_pb2.GenerationResult]]:
        t0 = time.perf_counter()
        results = []
        for i in range(self.args.images):
            request = gateway_pb2.GenerateUnaryRequest(params=self.params(self.args.seed + i, 1))
            results.append(self.stub.GenerateUnary(request, timeout=CALL_TIMEOUT_S).result)
        return time.perf_counter() - t0, results

    def close(self) -> None:
        self.channel.close()


def _pixels(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("RGB")).astype(np.int16)


def compare(batched: list, alone: list) -> dict:
    """Whether both paths drew the same images: same bytes, or by how many levels they differ."""
    diffs = [int(np.abs(_pixels(a.png) - _pixels(b.png)).max()) for a, b in zip(batched, alone)]
    return {
        "same_seeds": [r.seed for r in batched] == [r.seed for r in alone],
        "identical_bytes": all(a.png == b.png for a, b in zip(batched, alone)),
        "max_level_diff": max(diffs),
    }


def stage_ms(results: list) -> dict[str, list[float]]:
    return {stage: [round(r.stage_latency_ms[stage], 3) for r in results] for stage in ("0", "1")}


def measure(args: argparse.Namespace, address: str) -> dict:
    client = Client(address, args)
    try:
        _, batched = client.one_request()
        _, alone = client.sequential()
        same = compare(batched, alone)
        if not same["same_seeds"] or same["max_level_diff"] > 2:
            raise RuntimeError(f"the two paths drew different images: {same}")
        for _ in range(args.warmup):
            client.one_request()
            client.sequential()
        rounds = []
        print(f"measuring {args.repeats} rounds ...", flush=True)
        for i in range(args.repeats):
            order = ("one", "sequential") if i % 2 == 0 else ("sequential", "one")
            row = {}
            for name in order:
                wall, results = client.one_request() if name == "one" else client.sequential()
                row[name] = {"wall_s": wall, "stage_ms": stage_ms(results)}
            rounds.append(row)
    finally:
        client.close()
    return {"equality": same, "rounds": rounds}


def forward_costs(args: argparse.Namespace) -> dict:
    """The diffusion stage's work alone, in this process with the stage's thread setting: batch 1
    and batch N, median of --forward-repeats runs each (no gRPC, no pipe, no encoding)."""
    import torch

    from stagemesh.core.params import Params
    from stagemesh.stage_service.models.contract import WorkItem
    from stagemesh.stage_service.models.runners import ArRunner, DiffusionRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    ar, diffusion = ArRunner(Path(args.model_dir), args.device), DiffusionRunner(Path(args.model_dir), args.device)

    def items(n: int) -> list[WorkItem]:
        size, steps = args.size, args.steps
        batch = [WorkItem("r", Params(PROMPT, size, size, steps, 4.0, args.seed + i, "png")) for i in range(n)]
        for item, encoded in zip(batch, ar.run(batch)):
            item.inputs = encoded
        return batch

    def median_s(batch: list[WorkItem]) -> float:
        diffusion.run(batch)
        times = []
        for _ in range(args.forward_repeats):
            t0 = time.perf_counter()
            images = diffusion.run(batch)
            images[-1]["image"].cpu()  # waits for the device
            times.append(time.perf_counter() - t0)
        return common.percentile(times, 50)

    one_item, n_items = items(1), items(args.images)
    t0 = time.perf_counter()
    ar.run(one_item)
    ar_s = time.perf_counter() - t0
    single, batched = median_s(one_item), median_s(n_items)
    return {
        "torch_threads": torch.get_num_threads(),
        "ar_encode_one_s": ar_s,
        "diffusion_batch1_s": single,
        f"diffusion_batch{args.images}_s": batched,
        "batching_ceiling": args.images * single / batched,
    }


def summarize(args: argparse.Namespace, run: dict, forward: dict) -> dict:
    one = [r["one"]["wall_s"] for r in run["rounds"]]
    seq = [r["sequential"]["wall_s"] for r in run["rounds"]]
    ratios = [s / o for s, o in zip(seq, one)]
    ratio = common.percentile(ratios, 50)
    median = {"one": common.percentile(one, 50), "sequential": common.percentile(seq, 50)}
    return {
        "config": {
            "images": args.images,
            "size": args.size,
            "steps": args.steps,
            "guidance": 4.0,
            "output": "PNG",
            "device": args.device,
            "max_batch_size": args.max_batch_size,
            "batch_invariant": args.batch_invariant,
            "threads": args.threads or "torch default",
            "rounds": args.repeats,
            "warmup": args.warmup,
            "order": "alternating",
        },
        "equality": run["equality"],
        "wall_s": {"one_request": common.summarize(one), "sequential": common.summarize(seq)},
        "images_per_s": {name: args.images / value for name, value in median.items()},
        "ratio": {"median": ratio, "min": min(ratios), "max": max(ratios)},
        "target": {"ratio_min": TARGET_RATIO, "met": ratio >= TARGET_RATIO},
        "stage_ms_median": {
            path: {
                stage: common.percentile([v for r in run["rounds"] for v in r[path]["stage_ms"][stage]], 50)
                for stage in ("0", "1")
            }
            for path in ("one", "sequential")
        },
        "forward": forward,
        "rounds": run["rounds"],
    }


def report(results: dict) -> None:
    c, w, ips, r = results["config"], results["wall_s"], results["images_per_s"], results["ratio"]
    print()
    print(
        f"{c['images']} images of {c['size']}x{c['size']}, {c['steps']} steps, PNG, on {c['device']}; max_batch_size "
        f"{c['max_batch_size']}, batch_invariant {c['batch_invariant']}, threads {c['threads']}; {c['rounds']} rounds"
    )
    common.print_table(
        ["path", "wall p50 s", "min s", "max s", "images/s"],
        [
            [
                f"one request, num_images={c['images']}",
                w["one_request"]["p50"],
                w["one_request"]["min"],
                w["one_request"]["max"],
                ips["one"],
            ],
            [
                f"{c['images']} requests one after the other",
                w["sequential"]["p50"],
                w["sequential"]["min"],
                w["sequential"]["max"],
                ips["sequential"],
            ],
        ],
    )
    s = results["stage_ms_median"]
    f = results["forward"]
    print()
    print("where the time goes (ms, median per image as the gateway saw it):")
    common.print_table(
        ["path", "stage 0 (ar)", "stage 1 (diffusion)"],
        [["one request", s["one"]["0"], s["one"]["1"]], ["sequential", s["sequential"]["0"], s["sequential"]["1"]]],
    )
    n = c["images"]
    print(
        f"diffusion forward alone (torch threads {f['torch_threads']}): "
        f"batch 1 {f['diffusion_batch1_s'] * 1e3:.1f} ms, "
        f"batch {n} {f[f'diffusion_batch{n}_s'] * 1e3:.1f} ms -> batching ceiling {f['batching_ceiling']:.2f}x; "
        f"ar encode {f['ar_encode_one_s'] * 1e3:.1f} ms per prompt"
    )
    e = results["equality"]
    print(
        f"same images on both paths: identical bytes {e['identical_bytes']}, "
        f"max difference {e['max_level_diff']} levels"
    )
    verdict = "met" if results["target"]["met"] else "NOT met"
    print(
        f"\nspeed-up (sequential / one request): {r['median']:.2f}x (rounds {r['min']:.2f}-{r['max']:.2f}); "
        f"target >= {TARGET_RATIO}x -> {verdict}",
        flush=True,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4, help="num_images of the one request (default: 4)")
    parser.add_argument("--size", type=int, default=256, help="width and height (default: 256, the default size)")
    parser.add_argument("--steps", type=int, default=8, help="num_inference_steps (default: 8, the default)")
    common.add_repeats(parser, 10, "measured rounds of both paths (default: 10)", "--rounds")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first (default: 2)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of image 0 (default: 1234)")
    parser.add_argument("--max-batch-size", type=int, default=4, help="the stages' max_batch_size (default: 4)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per stage worker; 0: torch's default")
    parser.add_argument("--device", default="cpu", help="the stages' device, e.g. cuda (default: cpu)")
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the diffusion stage's batch_invariant (default: on, the stage's default: every pass runs "
        "max_batch_size rows, so a one-image request costs a full batch)",
    )
    parser.add_argument("--forward-repeats", type=int, default=5, help="runs of the in-process forward (default: 5)")
    common.add_model_dir(parser, "default: the embedded model's cache folder")
    common.add_output(parser, "num_images")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.images < 2 or args.repeats < 1 or args.warmup < 0:
        parser.error("--images must be >= 2, --repeats >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.prepare_mesh_run(args)
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-") as tmp:
        root = Path(tmp)
        config = write_mesh_config(root / "mesh.toml", args)
        print(f"starting the mesh (model dir {args.model_dir}) ...", flush=True)
        run, code = measured_on_mesh(config, root / "mesh.log", lambda mesh: measure(args, mesh.address))
    forward = forward_costs(args)
    results = summarize(args, run, forward)
    results["mesh_exit_code"] = code
    report(results)
    path = common.write_json(args.output, "num_images", results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    common.run_mesh_script(main)

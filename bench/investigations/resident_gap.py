"""Where the resident mesh's extra time per image goes, against diffusers' pipeline on the same
folder: the mesh's own trace spans (gateway, each stage's server, queue, worker compute, output
delivery, relays, image encoding) beside diffusers' pipeline timed in its parts (encode_prompt,
the VAE's decode, the rest).

The mesh exports its spans to a collector in this process (OTLP over gRPC,
tests/support/otlp_collector.py); each span's start is printed relative to the gateway's server
span of its request, medians over the timed requests, so a gap between two spans is time no span
covers.
Run: python -m bench.investigations.resident_gap --family flux2-klein --model-dir /tmp/fam
     (writes FAMILY/ under --model-dir when absent; CPU: --preset tiny-folders --device cpu)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench import common, families
from stagemesh.gateway.images import encode_png
from tests.support.meshproc import start_mesh
from tests.support.otlp_collector import Collector


def _synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timing(fn, device: torch.device, into: list[float]):
    def timed(*args, **kwargs):
        _synced(device)
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        _synced(device)
        into.append((time.perf_counter() - started) * 1e3)
        return out

    return timed


def diffusers_parts(folder: Path, family: str, device: torch.device, args) -> dict[str, float]:
    """Median ms of the whole call, its encode_prompt and its VAE decodes, and the PNG."""
    pipe = families.load_diffusers(folder, args)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    encode: list[float] = []
    decode: list[float] = []
    pipe.encode_prompt = _timing(pipe.encode_prompt, device, encode)
    pipe.vae.decode = _timing(pipe.vae.decode, device, decode)
    call = families.pipeline_call(family, args)
    whole: list[float] = []
    png: list[float] = []
    for _ in range(args.warmup + args.repeats):
        started = time.perf_counter()
        image = pipe(**call, generator=torch.Generator().manual_seed(args.seed)).images[0]
        pixels = image.permute(1, 2, 0).float().cpu().numpy()
        encoded = time.perf_counter()
        encode_png(pixels)
        png.append((time.perf_counter() - encoded) * 1e3)
        whole.append((time.perf_counter() - started) * 1e3)
    del pipe
    common.free_device(device)
    calls = max(1, len(encode) // (args.warmup + args.repeats))  # CFG may encode twice a request
    n = args.repeats
    return {
        "whole": statistics.median(whole[-n:]),
        "encode_prompt (all calls)": calls * statistics.median(encode[-n * calls :]),
        "vae decode": statistics.median(decode[-n:]),
        "png": statistics.median(png[-n:]),
    }


def mesh_spans(folder: Path, family: str, device: torch.device, args, work: Path) -> tuple[list, float]:
    collector = Collector()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="50",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
    )
    config = families._mesh_config(work / "gap.toml", str(device), dlo=False)
    mesh = start_mesh(config, work / "gap.log", ("--model", str(folder)), timeout_s=1800, env=env)
    request = families.mesh_request(family, args)
    client: list[float] = []
    try:
        with mesh.channel() as channel:
            stub = mesh.gateway(channel)
            for _ in range(args.warmup + args.repeats):
                started = time.perf_counter()
                stub.GenerateUnary(request, timeout=3600)
                client.append((time.perf_counter() - started) * 1e3)
        time.sleep(1.0)
        spans = collector.spans()
    finally:
        mesh.stop(timeout=300)
        collector.stop()
    return spans, statistics.median(client[-args.repeats :])


def timeline(spans: list, repeats: int) -> list[tuple[str, float, float]]:
    """(service/name, median start after the request's gateway span began, median duration)."""
    traces: dict[str, list] = defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    tops = (min((s for s in g if not s.parent_id), key=lambda s: s.start_ns, default=None) for g in traces.values())
    roots = sorted((r for r in tops if r is not None), key=lambda s: s.start_ns)[-repeats:]
    rows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for root in roots:
        seen: dict[str, int] = defaultdict(int)
        for s in sorted(traces[root.trace_id], key=lambda s: s.start_ns):
            key = f"{s.service}/{s.name}"
            seen[key] += 1
            label = key if seen[key] == 1 else f"{key} #{seen[key]}"
            rows[label].append(((s.start_ns - root.start_ns) / 1e6, (s.end_ns - s.start_ns) / 1e6))
    out = [
        (label, statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
        for label, values in rows.items()
    ]
    return sorted(out, key=lambda row: row[1])


def build_parser():
    p = families.build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.set_defaults(repeats=5, steps=4)
    p.add_argument("--family", default="flux2-klein", choices=sorted(families.FAMILIES))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the mesh's stages get (bench/families.py does the same)
    with tempfile.TemporaryDirectory(prefix="gap-") as tmp:
        work = Path(tmp)
        folder = (Path(args.model_dir) if args.model_dir else work) / args.family
        if not (folder / "model_index.json").is_file():
            families.write_folder(folder, args.family, args)
        parts = diffusers_parts(folder, args.family, device, args)
        spans, client_ms = mesh_spans(folder, args.family, device, args, work)
    rows = timeline(spans, args.repeats)
    print(f"\n{args.family}, {args.steps} steps, medians of {args.repeats} requests (ms)")
    print(f"diffusers: {parts}")
    print(f"mesh, client-observed: {client_ms:.1f}")
    common.print_table(["span", "start", "duration"], [[r[0], f"{r[1]:.1f}", f"{r[2]:.1f}"] for r in rows])
    out = args.output or common.RESULTS_DIR / "resident-gap.json"
    common.write_json(out, "resident_gap", {"diffusers": parts, "mesh_client_ms": client_ms, "spans": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the HTTP front door costs against the gRPC one: the same tiny request through both, in one run.

Starts a real mesh (`stagemesh up` with `[gateway] http_port = 0`: cache, stage 0 "ar", stage 1
"diffusion", the gateway serving gRPC and HTTP from one process) in a temp dir, then interleaves
N iterations of

  (a) gRPC: GatewayService.GenerateUnary (size x size, `--steps` steps, fixed seed, PNG), one
      synchronous grpc channel opened once;
  (b) HTTP: POST /v1/images/generations with the same fields as JSON, over one keep-alive
      http.client connection opened once, until the PNG is decoded from the answer's base64.

The order alternates every iteration so drift and ordering effects cancel. Each request carries
its own request id, so the gateway's log gives how long its handler took for each path ("rpc
done" / "http done"): what is left of a latency is the client library and the transport. Reports
p50/p90/p99/mean for both, HTTP - gRPC at p50 and p99, the ratio, the paired per-iteration
difference, and that split.

    python -m bench.http_overhead [--requests 300] [--size 16] [--steps 1] [--output PATH]

Target: HTTP adds <= 1 ms at p50.
"""

from __future__ import annotations

import argparse
import base64
import gc
import http.client
import json
import os
import time

import grpc

from bench import common, meshes
from stagemesh.core import rpc
from stagemesh.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2
from tests.support.meshproc import Mesh

TARGET_P50_OVERHEAD_MS = 1.0
CALL_TIMEOUT_S = 60.0
PROMPT = "a lighthouse at dusk"


def _ms(ns: int) -> float:
    return ns / 1e6


def _up_log(mesh: Mesh) -> list[dict]:
    entries = []
    for line in mesh.logs().splitlines():
        if line.startswith("{"):
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
    return entries


def http_address(mesh: Mesh) -> str:
    """The HTTP API's address, from `up`'s "serving" line of the gateway."""
    for entry in reversed(_up_log(mesh)):
        if entry.get("event") == "serving" and entry.get("child") == "gateway" and entry.get("http"):
            return entry["http"]
    raise RuntimeError("the mesh log names no HTTP address for the gateway")


def handler_ms(mesh: Mesh) -> dict[str, float]:
    """request id -> milliseconds the gateway's handler took ("rpc done" of GenerateUnary, "http done")."""
    out = {}
    for entry in _up_log(mesh):
        if entry.get("service") != "gateway" or "request_id" not in entry:
            continue
        if entry.get("event") == "rpc done" and entry.get("method") == "GenerateUnary":
            out[entry["request_id"]] = float(entry["ms"])
        elif entry.get("event") == "http done" and entry.get("path") == "/v1/images/generations":
            out[entry["request_id"]] = float(entry["ms"])
    return out


class GrpcPath:
    name = "grpc"

    def __init__(self, address: str, args: argparse.Namespace):
        self.channel = grpc.insecure_channel(address, options=rpc.channel_options())
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        self.params = generation_pb2.GenerationParams(
            prompt=PROMPT,
            width=args.size,
            height=args.size,
            num_inference_steps=args.steps,
            seed=args.seed,
            output_format=generation_pb2.OUTPUT_FORMAT_PNG,
        )

    def run(self, request_id: str) -> tuple[int, bytes]:
        t0 = time.perf_counter_ns()
        reply = self.stub.GenerateUnary(
            gateway_pb2.GenerateUnaryRequest(params=self.params, request_id=request_id), timeout=CALL_TIMEOUT_S
        )
        return time.perf_counter_ns() - t0, reply.result.png

    def close(self) -> None:
        self.channel.close()


class HttpPath:
    name = "http"

    def __init__(self, address: str, args: argparse.Namespace):
        host, port = address.rsplit(":", 1)
        self.connection = http.client.HTTPConnection(host, int(port), timeout=CALL_TIMEOUT_S)
        self.body = json.dumps(
            {
                "prompt": PROMPT,
                "size": f"{args.size}x{args.size}",
                "num_inference_steps": args.steps,
                "seed": args.seed,
                "output_format": "png",
            }
        ).encode()

    def run(self, request_id: str) -> tuple[int, bytes]:
        t0 = time.perf_counter_ns()
        self.connection.request(
            "POST",
            "/v1/images/generations",
            body=self.body,
            headers={"content-type": "application/json", "x-request-id": request_id},
        )
        reply = self.connection.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {data[:500]!r}")
        png = base64.b64decode(json.loads(data)["data"][0]["b64_json"])
        return time.perf_counter_ns() - t0, png

    def close(self) -> None:
        self.connection.close()


def measure(args: argparse.Namespace, mesh: Mesh) -> dict:
    http_at = http_address(mesh)
    paths = [GrpcPath(mesh.address, args), HttpPath(http_at, args)]
    try:
        print(f"mesh: gRPC {mesh.address}, HTTP {http_at}", flush=True)
        first = {p.name: p.run(f"check-{p.name}")[1] for p in paths}
        if first["grpc"] != first["http"]:
            raise RuntimeError("gRPC and HTTP produced different PNGs: not the same work")
        for i in range(args.warmup):
            for p in paths:
                p.run(f"warmup-{p.name}-{i}")
        gc.collect()
        loadavg_before = list(os.getloadavg())
        samples: dict[str, list[int]] = {"grpc": [], "http": []}
        ids: dict[str, list[str]] = {"grpc": [], "http": []}
        print(f"measuring {args.requests} iterations per path ...", flush=True)
        for i in range(args.requests):
            for p in paths if i % 2 == 0 else reversed(paths):
                request_id = f"bench-{p.name}-{i}"
                samples[p.name].append(p.run(request_id)[0])
                ids[p.name].append(request_id)
    finally:
        for p in paths:
            p.close()
    time.sleep(1.0)  # the last "done" lines reach the log
    handled = handler_ms(mesh)
    return _summary(args, mesh, http_at, samples, ids, handled, loadavg_before)


def _summary(args, mesh, http_at, samples, ids, handled, loadavg_before) -> dict:
    g_ms = [_ms(v) for v in samples["grpc"]]
    h_ms = [_ms(v) for v in samples["http"]]
    g, h = common.summarize(g_ms), common.summarize(h_ms)
    server = {name: [handled[r] for r in ids[name] if r in handled] for name in ids}
    outside = {
        name: [total - handled[r] for total, r in zip(ms, ids[name]) if r in handled]
        for name, ms in (("grpc", g_ms), ("http", h_ms))
    }
    return {
        "config": {
            "requests": args.requests,
            "warmup": args.warmup,
            "size": args.size,
            "steps": args.steps,
            "seed": args.seed,
            "prompt": PROMPT,
            "grpc_client": "grpc sync, one channel",
            "http_client": "http.client, one keep-alive connection, JSON + base64 decoded",
            "order": "alternating (grpc, http), (http, grpc)",
        },
        "mesh": {"grpc": mesh.address, "http": http_at},
        "loadavg_before": loadavg_before,
        "grpc": g,
        "http": h,
        "paired_diff": common.summarize([b - a for a, b in zip(g_ms, h_ms)]),
        "overhead": {
            "p50_ms": h["p50"] - g["p50"],
            "p99_ms": h["p99"] - g["p99"],
            "mean_ms": h["mean"] - g["mean"],
            "p50_ratio": h["p50"] / g["p50"],
            "p99_ratio": h["p99"] / g["p99"],
        },
        "target": {"p50_overhead_ms_max": TARGET_P50_OVERHEAD_MS, "met": h["p50"] - g["p50"] <= TARGET_P50_OVERHEAD_MS},
        "split_p50_ms": {
            name: {
                "gateway_handler": common.percentile(server[name], 50) if server[name] else None,
                "client_and_transport": common.percentile(outside[name], 50) if outside[name] else None,
            }
            for name in ("grpc", "http")
        },
        "raw_ms": {"grpc": [round(v, 4) for v in g_ms], "http": [round(v, 4) for v in h_ms]},
    }


def report(results: dict) -> None:
    c = results["config"]
    print(f"\nlatency in ms, {c['requests']} requests per path ({c['size']}x{c['size']}, {c['steps']} step, PNG)")
    common.print_table(
        ["path", "p50", "p90", "p99", "mean", "min", "max"],
        [
            [name, s["p50"], s["p90"], s["p99"], s["mean"], s["min"], s["max"]]
            for name, s in (
                ("grpc", results["grpc"]),
                ("http", results["http"]),
                ("paired (http-grpc)", results["paired_diff"]),
            )
        ],
    )
    o = results["overhead"]
    print()
    common.print_table(
        ["http - grpc", "ms", "ratio http/grpc"],
        [["p50", o["p50_ms"], o["p50_ratio"]], ["p99", o["p99_ms"], o["p99_ratio"]]],
    )
    split = results["split_p50_ms"]
    print("\nwhere the time goes (p50, ms): the gateway's handler, and the rest (client library, transport):")
    common.print_table(
        ["path", "gateway handler", "client + transport"],
        [[name, split[name]["gateway_handler"], split[name]["client_and_transport"]] for name in ("grpc", "http")],
    )
    load = ", ".join(f"{x:.2f}" for x in results["loadavg_before"])
    print(f"load average before: {load} on {common.usable_cpus()} CPUs")
    verdict = "met" if results["target"]["met"] else "NOT met"
    print(f"\ntarget: HTTP adds <= {TARGET_P50_OVERHEAD_MS} ms at p50 -> {verdict} ({o['p50_ms']:.3f} ms)", flush=True)


def build_parser() -> argparse.ArgumentParser:
    return meshes.overhead_parser(__doc__ or "", "http_overhead")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return meshes.parse_overhead_args(build_parser(), argv)


def main(argv: list[str] | None = None) -> int:
    return meshes.run_on_mesh(parse_args(argv), "http_overhead", measure, report, extra_gateway="http_port = 0")


if __name__ == "__main__":
    common.run_mesh_script(main)

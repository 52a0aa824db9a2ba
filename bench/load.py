"""Load through the gateway: N concurrent clients x M requests each, every request accounted for.

Each client has its own channel and sends its requests one after another. The mix, by request
index: mostly GenerateUnary at `--size`/`--steps`; every `--cancel-every`-th a streaming Generate
the client cancels after its first denoising step; every `--big-every`-th a GenerateUnary at
`--big-size` (an image over 1 MB, so it travels through shared memory). Reports p50/p99 latency
per kind, QPS, and the count of every status code; a request without an outcome is "lost".

    python -m bench.load [--clients 32] [--requests 10] [--size 64] [--steps 2] [--address HOST:PORT]

Without --address it starts its own mesh (`stagemesh up`, the tiny model) and stops it after. The
fd and thread counts of every mesh process before and after the load are reported too.
tests/e2e/test_load.py runs the same driver at a small scale.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench import common
from bench.meshes import mesh_processes, mesh_segments, process_resources, start_mesh, stop_mesh
from stagemesh.core import rpc
from stagemesh.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2
from tests.support.meshproc import write_config

CALL_TIMEOUT_S = 120.0
UNARY, CANCEL, BIG = "unary", "cancel", "big"


@dataclass(frozen=True)
class Mix:
    size: int = 64
    steps: int = 2
    big_size: int = 304  # 304 * 304 * 3 float32 = 1.1 MB, above the 1 MB shared-memory threshold
    cancel_every: int = 0  # 0: never
    big_every: int = 0

    def kind(self, client: int, index: int) -> str:
        # Offset by client, so even one request per client covers every kind.
        n = client + index + 1
        if self.cancel_every and n % self.cancel_every == 0:
            return CANCEL
        if self.big_every and n % self.big_every == self.big_every // 2:
            return BIG
        return UNARY

    def params(self, kind: str, seed: int) -> generation_pb2.GenerationParams:
        side = self.big_size if kind == BIG else self.size
        steps = 1 if kind == BIG else self.steps
        return generation_pb2.GenerationParams(
            prompt="load", width=side, height=side, num_inference_steps=steps, seed=seed
        )


@dataclass(frozen=True)
class Outcome:
    kind: str
    code: str  # a grpc.StatusCode name
    latency_s: float


# the clients --------------------------------------------------------------------------------
async def _one(stub: gateway_pb2_grpc.GatewayServiceStub, kind: str, params) -> str:
    if kind != CANCEL:
        await stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=CALL_TIMEOUT_S)
        return "OK"
    call = stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=CALL_TIMEOUT_S)
    async for event in call:
        if event.HasField("denoising_step"):
            call.cancel()
            break
        if event.HasField("result"):
            return "OK"
    return (await call.code()).name  # CANCELLED once cancelled


async def _client(address: str, client: int, requests: int, mix: Mix) -> list[Outcome]:
    outcomes = []
    async with grpc.aio.insecure_channel(address, options=rpc.channel_options()) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for index in range(requests):
            kind = mix.kind(client, index)
            started = time.perf_counter()
            try:
                code = await _one(stub, kind, mix.params(kind, seed=client * 1000 + index))
            except grpc.aio.AioRpcError as err:
                code = err.code().name
            outcomes.append(Outcome(kind, code, time.perf_counter() - started))
    return outcomes


def run_load(address: str, clients: int, requests: int, mix: Mix) -> tuple[list[Outcome], float]:
    """Run the clients to completion; returns every outcome and the wall time."""

    async def main() -> list[list[Outcome]]:
        return await asyncio.gather(*(_client(address, c, requests, mix) for c in range(clients)))

    started = time.perf_counter()
    per_client = asyncio.run(main())
    return [o for outcomes in per_client for o in outcomes], time.perf_counter() - started


def summarize(outcomes: list[Outcome], wall_s: float, expected: int) -> dict:
    by_kind = collections.defaultdict(list)
    for o in outcomes:
        by_kind[o.kind].append(o)
    ok = [o.latency_s * 1e3 for o in outcomes if o.code == "OK"]
    return {
        "requests": expected,
        "outcomes": len(outcomes),
        "lost": expected - len(outcomes),
        "wall_s": wall_s,
        "qps_ok": len(ok) / wall_s,
        "status_counts": dict(collections.Counter(o.code for o in outcomes)),
        "latency_ms": {
            kind: {
                "codes": dict(collections.Counter(o.code for o in items)),
                **common.summarize([o.latency_s * 1e3 for o in items]),
            }
            for kind, items in sorted(by_kind.items())
        },
    }


# the script ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default: 32)")
    parser.add_argument("--requests", type=int, default=10, help="requests per client (default: 10)")
    parser.add_argument("--size", type=int, default=64, help="width and height (default: 64)")
    parser.add_argument("--steps", type=int, default=2, help="num_inference_steps (default: 2)")
    parser.add_argument("--cancel-every", type=int, default=10, help="every Nth request a cancelled stream (0: none)")
    parser.add_argument("--big-every", type=int, default=10, help="every Nth request a --big-size image (0: none)")
    parser.add_argument("--big-size", type=int, default=304, help="side of those images (default: 304, 1.1 MB)")
    parser.add_argument("--address", default=None, help="an existing gateway (default: start a mesh)")
    common.add_model_dir(parser, "when starting a mesh; default: the embedded model's cache folder")
    common.add_output(parser, "load")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.clients < 1 or args.requests < 1:
        parser.error("--clients and --requests must be >= 1")
    return args


def measure(args: argparse.Namespace, address: str, up_pid: int | None) -> dict:
    mix = Mix(args.size, args.steps, args.big_size, cancel_every=args.cancel_every, big_every=args.big_every)
    run_load(address, args.clients, 1, mix)  # warm-up: connections, thread pools, shared-memory slots
    procs = mesh_processes(up_pid) if up_pid else {}
    before = {name: process_resources(pid) for name, pid in procs.items()}
    outcomes, wall_s = run_load(address, args.clients, args.requests, mix)
    after = {name: process_resources(pid) for name, pid in procs.items()}
    return {
        "config": {
            "clients": args.clients,
            "requests_per_client": args.requests,
            "size": args.size,
            "steps": args.steps,
            "cancel_every": args.cancel_every,
            "big_every": args.big_every,
            "big_size": mix.big_size,
            "address": address,
        },
        **summarize(outcomes, wall_s, args.clients * args.requests),
        "processes": {name: {"before": before[name], "after": after[name]} for name in procs},
        "shm_segments_after": mesh_segments(procs.values()),
    }


def report(r: dict) -> None:
    c = r["config"]
    print(
        f"\n{c['clients']} clients x {c['requests_per_client']} requests ({c['size']}x{c['size']}, "
        f"{c['steps']} steps): {r['outcomes']} outcomes, {r['lost']} lost, {r['wall_s']:.1f} s, "
        f"{r['qps_ok']:.1f} QPS (OK only)"
    )
    rows = [
        [kind, s["count"], ", ".join(f"{k} {v}" for k, v in s["codes"].items()), s["p50"], s["p99"], s["max"]]
        for kind, s in r["latency_ms"].items()
    ]
    common.print_table(["kind", "requests", "statuses", "p50 ms", "p99 ms", "max ms"], rows, floatfmt=".1f")
    if r["processes"]:
        print()
        common.print_table(
            ["process", "fds before", "after", "threads before", "after", "RSS MB after"],
            [
                [
                    name,
                    p["before"]["fds"],
                    p["after"]["fds"],
                    p["before"]["threads"],
                    p["after"]["threads"],
                    p["after"]["rss_bytes"] / 1e6,
                ]
                for name, p in r["processes"].items()
                if p["before"] and p["after"]
            ],
            floatfmt=".1f",
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.address:
        results = measure(args, args.address, None)
    else:
        common.prepare_mesh_run(args)
        with tempfile.TemporaryDirectory(prefix="stagemesh-load-") as tmp:
            mesh = start_mesh(write_config(Path(tmp) / "mesh.toml", Path(args.model_dir)), Path(tmp) / "mesh.log")
            try:
                results = measure(args, mesh.address, mesh.process.pid)
            finally:
                code = stop_mesh(mesh)
        results["mesh_exit_code"] = code
    report(results)
    print(f"wrote {common.write_json(args.output, 'load', results)}")
    return 0 if results["lost"] == 0 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)

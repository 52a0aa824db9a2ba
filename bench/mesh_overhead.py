"""What the gateway hop costs: a tiny Generate through the gateway against the same work done by
a client that calls the stage services itself.

Starts a real mesh (`stagemesh up`: cache, stage 0 "ar", stage 1 "diffusion", gateway) in a
temp dir, then interleaves N iterations of

  (a) gateway: GatewayService.GenerateUnary (size x size, `--steps` steps, fixed seed, PNG);
  (b) direct:  resolve the params like the gateway, StageService.Execute on stage 0, Execute on
               stage 1 with stage 0's outputs, encode the PNG with gateway.images.encode_png.

Both use the same synchronous grpc client (one channel per target, opened once). The order of
(a) and (b) alternates every iteration so drift and ordering effects cancel. Reports p50/p90/p99/
mean for both, gateway - direct at p50 and p99, the ratio, and a breakdown of where each path's
time goes (the gateway reports its own per-stage latency in GenerationResult.stage_latency_ms).

    python -m bench.mesh_overhead [--requests 300] [--size 16] [--steps 1] [--output PATH]

Target (issue): the gateway hop adds <= 1 ms at p50.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import grpc

from bench import common, meshes
from stagemesh.core import codec, converters, logs, rpc
from stagemesh.core.params import Limits
from stagemesh.gateway.images import encode_png
from stagemesh.v1 import (
    gateway_pb2,
    gateway_pb2_grpc,
    generation_pb2,
    stage_pb2,
    stage_pb2_grpc,
)
from tests.support.meshproc import Mesh

TARGET_P50_OVERHEAD_MS = 1.0
CALL_TIMEOUT_S = 60.0
PROMPT = "a lighthouse at dusk"


def _ms(ns: int) -> float:
    return ns / 1e6


# the two paths ------------------------------------------------------------------------------
class GatewayPath:
    name = "gateway"

    def __init__(self, address: str, params: generation_pb2.GenerationParams):
        self.channel = grpc.insecure_channel(address, options=rpc.channel_options())
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        self.params = params
        self.stage_ms: list[tuple[float, float]] = []  # the gateway's own view of each stage
        self.cpu_ns: list[int] = []  # this (client) process's CPU per call, all threads

    def run(self) -> tuple[int, bytes]:
        c0 = time.process_time_ns()
        t0 = time.perf_counter_ns()
        reply = self.stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=self.params), timeout=CALL_TIMEOUT_S)
        elapsed = time.perf_counter_ns() - t0
        self.cpu_ns.append(time.process_time_ns() - c0)
        lat = reply.result.stage_latency_ms
        self.stage_ms.append((lat["0"], lat["1"]))
        return elapsed, reply.result.png

    def close(self) -> None:
        self.channel.close()


class DirectPath:
    """The gateway's work (resolve, stage 0, stage 1 with stage 0's outputs, PNG), done by the client."""

    name = "direct"

    def __init__(self, addresses: list[str], params: generation_pb2.GenerationParams):
        self.channels = [grpc.insecure_channel(a, options=rpc.channel_options()) for a in addresses]
        self.stubs = [stage_pb2_grpc.StageServiceStub(c) for c in self.channels]
        self.params = params
        self.limits = self._limits()
        self.phase_ns: list[tuple[int, int, int]] = []  # stage 0, stage 1, PNG encode
        self.cpu_ns: list[int] = []  # this (client) process's CPU per call, all threads

    def _limits(self) -> Limits:
        """What the gateway's Pipeline.limits computes: the last stage's limits, the tightest prompt limit."""
        limits = [
            converters.limits_from_proto(s.DescribeStage(stage_pb2.DescribeStageRequest(), timeout=10).limits)
            for s in self.stubs
        ]
        return Limits(**{**limits[-1].__dict__, "max_prompt_bytes": min(x.max_prompt_bytes for x in limits)})

    def run(self) -> tuple[int, bytes]:
        c0 = time.process_time_ns()
        t0 = time.perf_counter_ns()
        request_id = logs.new_request_id()
        wire = converters.params_to_proto(converters.params_from_proto(self.params, self.limits))
        metadata = rpc.outgoing_metadata(request_id)
        inputs: dict = {}
        marks = []
        for stub in self.stubs:
            request = stage_pb2.ExecuteRequest(request_id=request_id, params=wire, inputs=inputs)
            for response in stub.Execute(request, timeout=CALL_TIMEOUT_S, metadata=metadata):
                if response.HasField("outputs"):
                    inputs = dict(response.outputs.outputs)
            marks.append(time.perf_counter_ns())
        png = encode_png(codec.to_array(inputs["image"], "image"))
        t1 = time.perf_counter_ns()
        self.cpu_ns.append(time.process_time_ns() - c0)
        self.phase_ns.append((marks[0] - t0, marks[1] - marks[0], t1 - marks[1]))
        return t1 - t0, png

    def close(self) -> None:
        for c in self.channels:
            c.close()


# in-process costs of what the gateway does between the stages -----------------------------
def relay_costs(
    stage0: stage_pb2_grpc.StageServiceStub, wire: generation_pb2.GenerationParams, reps: int = 2000
) -> dict[str, float]:
    """Microseconds per call for the protobuf work the gateway does on each request (and the
    direct client does too): parse stage 0's reply, re-serialize its outputs into stage 1's request."""
    request_id = logs.new_request_id()
    responses = list(
        stage0.Execute(
            stage_pb2.ExecuteRequest(request_id=request_id, params=wire),
            timeout=CALL_TIMEOUT_S,
            metadata=rpc.outgoing_metadata(request_id),
        )
    )
    reply = next(r for r in responses if r.HasField("outputs"))
    wire_reply = reply.SerializeToString()

    def per_call_us(fn) -> float:
        fn()
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            fn()
        return (time.perf_counter_ns() - t0) / reps / 1e3

    parsed = stage_pb2.ExecuteResponse.FromString(wire_reply)
    outputs = dict(parsed.outputs.outputs)
    return {
        "stage0_reply_bytes": len(wire_reply),
        "stage0_outputs": {k: {"dtype": t.dtype, "shape": list(t.shape)} for k, t in outputs.items()},
        "parse_stage0_reply_us": per_call_us(lambda: stage_pb2.ExecuteResponse.FromString(wire_reply)),
        "build_and_serialize_stage1_request_us": per_call_us(
            lambda: stage_pb2.ExecuteRequest(
                request_id=request_id, params=wire, inputs=dict(parsed.outputs.outputs)
            ).SerializeToString()
        ),
    }


# reporting ----------------------------------------------------------------------------------
def report(results: dict) -> None:
    g, d = results["gateway"], results["direct"]
    rows = [
        [name, s["p50"], s["p90"], s["p99"], s["mean"], s["min"], s["max"]]
        for name, s in (("gateway", g), ("direct", d), ("paired diff (g-d)", results["paired_diff"]))
    ]
    print()
    print(
        f"latency in ms, {results['config']['requests']} requests per path "
        f"({results['config']['size']}x{results['config']['size']}, {results['config']['steps']} step, PNG)"
    )
    common.print_table(["path", "p50", "p90", "p99", "mean", "min", "max"], rows)
    o = results["overhead"]
    print()
    common.print_table(
        ["gateway - direct", "ms", "ratio g/d"],
        [
            ["p50", o["p50_ms"], o["p50_ratio"]],
            ["p99", o["p99_ms"], o["p99_ratio"]],
            ["mean", o["mean_ms"], o["mean_ratio"]],
        ],
    )
    b = results["breakdown_p50_ms"]
    print()
    print("where the time goes (p50 of each part, ms):")
    common.print_table(
        ["part", "gateway", "direct"],
        [
            ["stage 0 call (as seen by the caller)", b["gateway"]["stage0"], b["direct"]["stage0"]],
            ["stage 1 call (as seen by the caller)", b["gateway"]["stage1"], b["direct"]["stage1"]],
            [
                "the rest (gateway: client hop, resolve, PNG, reply; direct: PNG)",
                b["gateway"]["outside_stages"],
                b["direct"]["png_encode"],
            ],
        ],
    )
    c = results["cpu_ms_per_request"]
    gw_cpu = "n/a" if c["gateway_process"] is None else f"{c['gateway_process']:.2f}"
    print(
        f"CPU per request (ms): gateway process {gw_cpu} (mean); client side p50: gateway path "
        f"{c['client_gateway_path']:.2f}, direct path {c['client_direct_path']:.2f}; "
        f"load average before: {', '.join(f'{x:.2f}' for x in results['loadavg_before'])} "
        f"on {common.usable_cpus()} CPUs"
    )
    verdict = "met" if results["target"]["met"] else "NOT met"
    print(
        f"\ntarget: gateway hop <= {TARGET_P50_OVERHEAD_MS} ms at p50 -> {verdict} ({o['p50_ms']:.3f} ms)", flush=True
    )


# main ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    return meshes.overhead_parser(__doc__ or "", "mesh_overhead")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return meshes.parse_overhead_args(build_parser(), argv)


def measure(args: argparse.Namespace, mesh: Mesh) -> dict:
    stages = meshes.stage_addresses(mesh.logs())
    if sorted(stages) != [0, 1]:
        raise RuntimeError(f"expected stage 0 and stage 1 in the mesh log, found {stages}")
    params = generation_pb2.GenerationParams(
        prompt=PROMPT,
        width=args.size,
        height=args.size,
        num_inference_steps=args.steps,
        seed=args.seed,
        output_format=generation_pb2.OUTPUT_FORMAT_PNG,
    )
    gateway = GatewayPath(mesh.address, params)
    direct = DirectPath([stages[0], stages[1]], params)
    try:
        print(f"mesh: gateway {mesh.address}, stage 0 {stages[0]}, stage 1 {stages[1]}", flush=True)
        run = _sample_paths(args, mesh, gateway, direct)
        wire = converters.params_to_proto(converters.params_from_proto(params, direct.limits))
        run["relay_costs"] = relay_costs(direct.stubs[0], wire)
    finally:
        gateway.close()
        direct.close()
    return _summary(args, mesh, stages, gateway, direct, run)


def _sample_paths(args: argparse.Namespace, mesh: Mesh, gateway: GatewayPath, direct: DirectPath) -> dict:
    """Check both paths do the same work, warm them up, then time them in alternating order."""
    _, png_g = gateway.run()
    _, png_d = direct.run()
    if png_g != png_d:
        raise RuntimeError("the gateway and the direct client produced different PNGs: not the same work")
    for _ in range(args.warmup):
        gateway.run()
        direct.run()
    gateway.stage_ms.clear()
    direct.phase_ns.clear()
    gateway.cpu_ns.clear()
    direct.cpu_ns.clear()
    gc.collect()
    loadavg_before = list(os.getloadavg())
    gateway_pid = meshes.child_pids(mesh.logs()).get("gateway")
    gateway_cpu_before = meshes.process_cpu_s(gateway_pid)

    samples: dict[str, list[int]] = {"gateway": [], "direct": []}
    print(f"measuring {args.requests} iterations per path ...", flush=True)
    for i in range(args.requests):
        for path in (gateway, direct) if i % 2 == 0 else (direct, gateway):
            samples[path.name].append(path.run()[0])
    gateway_cpu_after = meshes.process_cpu_s(gateway_pid)
    # The gateway process's CPU over the measured loop (it only works on the gateway path).
    gateway_cpu_ms = (
        None
        if gateway_cpu_before is None or gateway_cpu_after is None
        else (gateway_cpu_after - gateway_cpu_before) / args.requests * 1e3
    )
    return {"samples": samples, "loadavg_before": loadavg_before, "gateway_cpu_ms": gateway_cpu_ms}


def _summary(
    args: argparse.Namespace, mesh: Mesh, stages: dict, gateway: GatewayPath, direct: DirectPath, run: dict
) -> dict:
    g_ms = [_ms(v) for v in run["samples"]["gateway"]]
    d_ms = [_ms(v) for v in run["samples"]["direct"]]
    g, d = common.summarize(g_ms), common.summarize(d_ms)
    paired = common.summarize([a - b for a, b in zip(g_ms, d_ms)])
    g_stage0 = [s0 for s0, _ in gateway.stage_ms]
    g_stage1 = [s1 for _, s1 in gateway.stage_ms]
    g_outside = [t - s0 - s1 for t, (s0, s1) in zip(g_ms, gateway.stage_ms)]
    d_phase = list(zip(*direct.phase_ns))
    return {
        "config": {
            "requests": args.requests,
            "warmup": args.warmup,
            "size": args.size,
            "steps": args.steps,
            "seed": args.seed,
            "prompt": PROMPT,
            "client": "grpc sync, one channel per target",
            "order": "alternating (gateway, direct), (direct, gateway)",
        },
        "mesh": {"gateway": mesh.address, "stages": {str(k): v for k, v in stages.items()}},
        "loadavg_before": run["loadavg_before"],
        "gateway": g,
        "direct": d,
        "paired_diff": paired,
        "overhead": {
            "p50_ms": g["p50"] - d["p50"],
            "p99_ms": g["p99"] - d["p99"],
            "mean_ms": g["mean"] - d["mean"],
            "p50_ratio": g["p50"] / d["p50"],
            "p99_ratio": g["p99"] / d["p99"],
            "mean_ratio": g["mean"] / d["mean"],
        },
        "target": {"p50_overhead_ms_max": TARGET_P50_OVERHEAD_MS, "met": g["p50"] - d["p50"] <= TARGET_P50_OVERHEAD_MS},
        "breakdown_p50_ms": {
            "gateway": {
                "stage0": common.percentile(g_stage0, 50),
                "stage1": common.percentile(g_stage1, 50),
                "outside_stages": common.percentile(g_outside, 50),
            },
            "direct": {
                "stage0": common.percentile([_ms(v) for v in d_phase[0]], 50),
                "stage1": common.percentile([_ms(v) for v in d_phase[1]], 50),
                "png_encode": common.percentile([_ms(v) for v in d_phase[2]], 50),
            },
        },
        "cpu_ms_per_request": {
            "gateway_process": run["gateway_cpu_ms"],
            "client_gateway_path": common.percentile([_ms(v) for v in gateway.cpu_ns], 50),
            "client_direct_path": common.percentile([_ms(v) for v in direct.cpu_ns], 50),
        },
        "relay_costs": run["relay_costs"],
        "raw_ms": {"gateway": [round(v, 4) for v in g_ms], "direct": [round(v, 4) for v in d_ms]},
    }


def main(argv: list[str] | None = None) -> int:
    return meshes.run_on_mesh(parse_args(argv), "mesh_overhead", measure, report)


if __name__ == "__main__":
    common.run_mesh_script(main)

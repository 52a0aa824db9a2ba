"""Gateway memory under clients that stop reading: N HTTP/2 connections each open a Generate
for a large tensor result and never grant flow-control window. Samples the gateway's RSS while
they hold their calls, then checks that a normal Generate is still answered.

    python -m bench.stalled_clients --clients 100 --hold-s 60

Prints a table and writes bench/results/stalled_clients.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench import common
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import Mesh, descendants, start_mesh, write_config
from tests.support.stalled_h2 import StalledClients

GENERATE_PATH = "/stagemesh.v1.GatewayService/Generate"
SAMPLE_EVERY_S = 0.5


def gateway_pid(mesh: Mesh) -> int:
    for pid in descendants(mesh.process.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if argv[1:4] == [b"-m", b"stagemesh", b"gateway"]:
            return pid
    raise RuntimeError("no gateway process under the mesh")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def stalled_request(size: int, steps: int) -> bytes:
    params = generation_pb2.GenerationParams(
        prompt="a stalled reader",
        width=size,
        height=size,
        num_inference_steps=steps,
        seed=1,
        output_format=generation_pb2.OUTPUT_FORMAT_TENSOR,
    )
    return gateway_pb2.GenerateRequest(params=params).SerializeToString()


def normal_generate_ok(mesh: Mesh) -> bool:
    small = generation_pb2.GenerationParams(prompt="a boat", width=32, height=32, num_inference_steps=1, seed=3)
    with mesh.channel() as channel:
        reply = mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=small), timeout=120)
    return reply.result.width == 32


def hold_stalled(mesh: Mesh, clients: int, size: int, steps: int, hold_s: float) -> dict:
    """RSS of the gateway while `clients` stalled calls are open, and how they ended."""
    pid = gateway_pid(mesh)
    normal_generate_ok(mesh)  # warm: the first call pays one-off allocations
    before = rss_mb(pid)
    stalled = StalledClients(mesh.address, GENERATE_PATH, stalled_request(size, steps), clients)
    samples = []
    started = time.monotonic()
    try:
        while time.monotonic() - started < hold_s:
            samples.append((round(time.monotonic() - started, 1), rss_mb(pid)))
            time.sleep(SAMPLE_EVERY_S)
        held = rss_mb(pid)
        answered_while_stalled = normal_generate_ok(mesh)
    finally:
        stalled.close()
    return {
        "clients": clients,
        "size": size,
        "steps": steps,
        "hold_s": hold_s,
        "rss_before_mb": round(before, 1),
        "rss_peak_mb": round(max(r for _, r in samples), 1),
        "rss_end_of_hold_mb": round(held, 1),
        "streams_reset_by_gateway": sum(c.reset for c in stalled.calls),
        "normal_generate_answered": answered_while_stalled,
        "samples": samples,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100, help="stalled connections (default: 100)")
    parser.add_argument("--size", type=int, default=512, help="width and height of each result (default: 512)")
    parser.add_argument("--steps", type=int, default=1, help="num_inference_steps (default: 1)")
    parser.add_argument("--hold-s", type=float, default=60.0, help="how long the clients stall (default: 60)")
    parser.add_argument("--gateway-toml", default="", help="extra [gateway] lines for the mesh (default: none)")
    parser.add_argument("--label", default="", help="recorded with the result, e.g. before/after")
    common.add_model_dir(parser, "default: the embedded model's cache folder")
    common.add_output(parser, "stalled_clients")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    common.prepare_mesh_run(args)
    with tempfile.TemporaryDirectory(prefix="stalled-clients-") as tmp:
        root = Path(tmp)
        config = write_config(root / "mesh.toml", Path(args.model_dir), extra_gateway=args.gateway_toml)
        mesh = start_mesh(config, root / "mesh.log")
        try:
            run = hold_stalled(mesh, args.clients, args.size, args.steps, args.hold_s)
        finally:
            mesh.stop()
    run["label"] = args.label
    keys = ("rss_before_mb", "rss_peak_mb", "rss_end_of_hold_mb", "streams_reset_by_gateway")
    common.print_table(
        ["label", "clients", *keys, "normal_ok"],
        [[args.label, run["clients"], *(run[k] for k in keys), run["normal_generate_answered"]]],
        ".1f",
    )
    print(f"wrote {common.write_json(args.output, 'stalled_clients', run)}")
    return 0


if __name__ == "__main__":
    common.run_mesh_script(main)

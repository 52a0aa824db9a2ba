"""Batch invariance through a real mesh: the same mixed requests served one at a time, then under
load (concurrent clients, so the diffusion stage batches them), compared byte for byte; the
diffusion stage's batch counters (stagemesh_stage_batches_total, ..._batched_requests_total)
show that the load did form batches of more than one and the first pass did not."""

from __future__ import annotations

import concurrent.futures as cf
import re
import urllib.request
from pathlib import Path

from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import Mesh, start_mesh, write_config

REQUESTS = 200
CLIENTS = 16
RPC_TIMEOUT_S = 300.0
# Lengths that put the conditioning into different padding buckets (8 to 64 tokens).
PROMPTS = (
    "a",
    "a red fox",
    "a lighthouse on a cliff at night",
    "an old city street in the rain, neon signs reflected in the puddles",
    "two cats",
    "a sailing boat on a calm lake at dawn",
)
# Few batch keys (size, steps, guidance), so that concurrent requests share them and batch.
SHAPES = ((32, 32, 2, 4.0), (48, 32, 2, 4.0), (32, 32, 1, 4.0), (32, 48, 2, 1.0))
_SAMPLE = re.compile(r"^(stagemesh_stage_batch(?:es|ed_requests)_total)\{[^}]*\} (\S+)$", re.MULTILINE)


def mixed_requests(count: int = REQUESTS) -> list[generation_pb2.GenerationParams]:
    out = []
    for i in range(count):
        width, height, steps, guidance = SHAPES[(i * 7) % len(SHAPES)]
        out.append(
            generation_pb2.GenerationParams(
                prompt=f"{PROMPTS[i % len(PROMPTS)]} {i}",
                width=width,
                height=height,
                num_inference_steps=steps,
                guidance_scale=guidance,
                seed=10_000 + 7919 * i,
            )
        )
    return out


def start_invariant_mesh(root: Path, model_dir: str, device: str = "cpu") -> Mesh:
    """A mesh whose diffusion stage runs with batch_invariant on (stated, whatever the default),
    batches of up to 4, and a metrics port for its batch counters."""
    extra = f'batch_invariant = true\nmax_batch_size = 4\nmetrics_port = 0\ndevice = "{device}"'
    config = write_config(root / "mesh.toml", Path(model_dir), cache_root=root / "cache", extra_diffusion=extra)
    return start_mesh(config, root / "mesh.log")


def batch_counters(mesh: Mesh) -> tuple[float, float]:
    """(batches, requests in them) of the diffusion stage, from its /metrics."""
    address = mesh.metrics_addresses()["stage-1"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        found = dict(_SAMPLE.findall(reply.read().decode()))
    return float(found["stagemesh_stage_batches_total"]), float(found["stagemesh_stage_batched_requests_total"])


def _png(stub, params: generation_pb2.GenerationParams) -> bytes:
    request = gateway_pb2.GenerateUnaryRequest(params=params)
    return stub.GenerateUnary(request, timeout=RPC_TIMEOUT_S).result.png


def serve_alone(mesh: Mesh, requests: list[generation_pb2.GenerationParams]) -> list[bytes]:
    with mesh.channel() as channel:
        stub = mesh.gateway(channel)
        return [_png(stub, params) for params in requests]


def serve_under_load(
    mesh: Mesh, requests: list[generation_pb2.GenerationParams], clients: int = CLIENTS
) -> list[bytes]:
    with mesh.channel() as channel, cf.ThreadPoolExecutor(clients) as pool:
        stub = mesh.gateway(channel)
        return list(pool.map(lambda params: _png(stub, params), requests))


def check_alone_equals_under_load(mesh: Mesh) -> None:
    requests = mixed_requests()
    before = batch_counters(mesh)
    alone = serve_alone(mesh, requests)
    middle = batch_counters(mesh)
    loaded = serve_under_load(mesh, requests)
    after = batch_counters(mesh)

    batches, batched = middle[0] - before[0], middle[1] - before[1]
    assert batched == batches == REQUESTS, f"served alone, every batch holds one request: {batches} {batched}"
    batches, batched = after[0] - middle[0], after[1] - middle[1]
    assert batched == REQUESTS and batches < REQUESTS, f"no batch of more than one formed: {batches} batches"
    assert all(alone), "every request got a PNG"
    differing = [i for i, (a, b) in enumerate(zip(alone, loaded)) if a != b]
    assert not differing, f"{len(differing)} of {REQUESTS} differ under load, e.g. {requests[differing[0]]}"

"""A bounded load through the shared session mesh: 32 concurrent clients x 10 requests (64x64,
2 steps; every tenth a stream the client cancels, every tenth a 304x304 image that travels
through shared memory). Every request gets a result or a clear status, and afterwards the mesh
holds no more segments, file descriptors or threads than before. bench/load.py is the same
driver at a larger scale."""

from __future__ import annotations

import collections
import os
import time

import pytest

from bench.load import BIG, CANCEL, UNARY, Mix, run_load
from bench.meshes import mesh_processes, mesh_segments, process_resources
from stagemesh.stage_service.transport.ipc import WORKER_POOL_SLOTS
from tests.e2e.test_lifecycle import generate

pytestmark = pytest.mark.mesh

CLIENTS, REQUESTS = 32, 10
MIX = Mix(size=64, steps=2, cancel_every=10, big_every=10)
# What may legitimately differ from the warmed-up baseline: an fd or two of a connection still
# closing, and asyncio's default thread pool (asyncio.to_thread) growing to its bound under the
# full load. A leak per request would exceed both by far (320 requests).
FD_MARGIN, THREAD_MARGIN = 2, min(32, (os.cpu_count() or 1) + 4)
SETTLE_S = 15.0


def resources(procs: dict[str, int]) -> dict[str, dict[str, int]]:
    return {name: process_resources(pid) for name, pid in procs.items()}


def over_margin(before: dict, after: dict) -> dict[str, tuple]:
    return {
        name: (before[name], after[name])
        for name in before
        if after[name] is None
        or after[name]["fds"] > before[name]["fds"] + FD_MARGIN
        or after[name]["threads"] > before[name]["threads"] + THREAD_MARGIN
    }


def test_32_clients_x_10_requests_lose_nothing_and_leak_nothing(mesh):
    run_load(mesh.address, CLIENTS, 1, MIX)  # warm-up: every kind once, pools and connections made
    procs = mesh_processes(mesh.process.pid)
    assert sorted(procs) == ["cache", "gateway", "stage-0", "stage-0/worker-0", "stage-1", "stage-1/worker-0"]
    before = resources(procs)

    outcomes, _ = run_load(mesh.address, CLIENTS, REQUESTS, MIX)

    assert len(outcomes) == CLIENTS * REQUESTS  # zero lost
    codes = collections.defaultdict(collections.Counter)
    for o in outcomes:
        codes[o.kind][o.code] += 1
    assert codes == {UNARY: {"OK": 256}, BIG: {"OK": 32}, CANCEL: {"CANCELLED": 32}}, dict(codes)
    # Client channels are closed; the services' side of them closes a moment later.
    deadline = time.monotonic() + SETTLE_S
    while (excess := over_margin(before, resources(procs))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not excess, f"(before, after) beyond the margin: {excess}"
    workers = [name for name in procs if "/worker-" in name]
    # Reusable slots may stay (at most WORKER_POOL_SLOTS per worker); one-shot segments must not.
    segments = mesh_segments(procs.values())
    assert len(segments) <= WORKER_POOL_SLOTS * len(workers), segments
    assert generate(mesh, timeout=10.0).png  # and the next request is served

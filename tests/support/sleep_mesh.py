"""A `stagemesh up` mesh (cache, ar stage, diffusion stage, gateway) whose stages can sleep,
shared by the sleep-and-wake tests: its fixtures, requests and gateway helpers.

Sleep mutates a mesh, so these tests never use the shared session one: `sleepy` (both stages can
sleep; one per session, in tests/e2e/conftest.py, for the modules that sleep and wake it) and
`sleepless` (enable_sleep = false; module-scoped). Every test leaves `sleepy` awake with
generation open (the `awake_and_open` fixture, autouse where imported), and a mesh is checked to
stop cleanly (exit 0, no shared-memory segment left) when it is done with.
"""

from __future__ import annotations

import json

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from stagemesh.v1 import control_pb2, gateway_pb2, generation_pb2
from tests.support.meshproc import Mesh, descendants, shm_entries, start_mesh, write_config

SMALL = generation_pb2.GenerationParams(prompt="a small boat", width=64, height=48, num_inference_steps=2, seed=7)
# Big enough that its image (384*384*3 float32 = 1.8 MB) travels through shared memory (past the
# 1 MB of SHM_THRESHOLD_BYTES), long enough (12 denoising steps) that a Sleep can arrive while it
# runs.
BIG = generation_pb2.GenerationParams(prompt="a long walk", width=384, height=384, num_inference_steps=12, seed=9)
SUCCESS = control_pb2.CONTROL_STATUS_SUCCESS
SKIPPED = control_pb2.CONTROL_STATUS_SKIPPED
ACK_SUCCESS = control_pb2.ACK_STATUS_SUCCESS
SERVING = gateway_pb2.STAGE_STATE_SERVING
SLEEPING = gateway_pb2.STAGE_STATE_SLEEPING
NOT_SLEEPING = "target stages are not sleeping"
RPC_TIMEOUT_S = 60.0


# ---- meshes ---------------------------------------------------------------------------------------
def owned_segments(pids: set[int]) -> set[str]:
    """/dev/shm segments of these processes: `stagemesh-<owner pid>-<rank>-...`. Other meshes (other
    test runs on this machine) have segments of their own; only ours count."""
    return {e for e in shm_entries() if e.startswith("stagemesh-") and e.split("-")[1] in {str(p) for p in pids}}


def stopped_cleanly(mesh: Mesh, pids: set[int]) -> None:
    code = mesh.stop()
    assert code == 0, mesh.logs()[-3000:]
    leaked = owned_segments(pids)
    assert not leaked, f"shared-memory segments left behind: {leaked}"


def start_sleep_mesh(root, model_dir, extra_stage: str = "") -> Mesh:
    mesh = start_mesh(write_config(root / "mesh.toml", model_dir, extra_stage=extra_stage), root / "mesh.log")
    mesh.pids = {mesh.process.pid, *descendants(mesh.process.pid)}  # services and their workers
    assert len(mesh.pids) >= 1 + 4, mesh.pids  # supervisor, cache, 2 stages (+ workers), gateway
    return mesh


@pytest.fixture(scope="module")
def sleepless(tmp_path_factory, model_dir):
    mesh = start_sleep_mesh(tmp_path_factory.mktemp("sleepless"), model_dir, extra_stage="enable_sleep = false")
    yield mesh
    stopped_cleanly(mesh, mesh.pids)


@pytest.fixture(scope="module")
def channel(sleepy):
    with sleepy.channel() as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(sleepy, channel):
    return sleepy.gateway(channel)


@pytest.fixture(scope="module")
def reference(stub) -> bytes:
    """SMALL's PNG before anything in this module slept."""
    return generate(stub, SMALL)


@pytest.fixture(autouse=True)
def awake_and_open(request):
    """Start each test from (and return the mesh to) all stages awake, generation open."""
    if "stub" not in request.fixturenames:
        yield
        return
    stub = request.getfixturevalue("stub")
    request.getfixturevalue("reference")  # taken before the first test can put anything to sleep
    yield
    if request.getfixturevalue("sleepy").process.poll() is not None:
        return
    stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[0, 1]), timeout=RPC_TIMEOUT_S)
    stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT_S)
    assert_all_serving(stub)


# ---- helpers --------------------------------------------------------------------------------------
def generate(stub, params=SMALL) -> bytes:
    reply = stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=RPC_TIMEOUT_S)
    assert reply.result.png.startswith(b"\x89PNG")
    return reply.result.png


def put_to_sleep(stub, stage_ids, level=None) -> gateway_pb2.SleepResponse:
    request = gateway_pb2.SleepRequest(stage_ids=stage_ids)
    if level is not None:
        request.level = level
    return stub.Sleep(request, timeout=RPC_TIMEOUT_S)


def wake_up(stub, stage_ids) -> gateway_pb2.WakeUpResponse:
    return stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=stage_ids), timeout=RPC_TIMEOUT_S)


def resume(stub) -> None:
    stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT_S)


def list_stages(stub) -> gateway_pb2.ListStagesResponse:
    return stub.ListStages(gateway_pb2.ListStagesRequest(), timeout=RPC_TIMEOUT_S)


def states(stub) -> dict[int, tuple[int, int]]:
    return {s.stage_id: (s.state, s.sleep_level) for s in list_stages(stub).stages}


def assert_all_serving(stub) -> None:
    listing = list_stages(stub)
    assert [(s.stage_id, s.state, s.sleep_level) for s in listing.stages] == [(0, SERVING, 0), (1, SERVING, 0)]
    assert not listing.generation_paused


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


def field_violations(exc: grpc.RpcError) -> dict[str, str]:
    status = rpc_status.from_call(exc)
    assert status is not None, "no google.rpc.Status in the trailers"
    out = {}
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out.update({v.field: v.description for v in bad.field_violations})
    return out


def assert_acks(acks, stage_ids, level) -> None:
    assert sorted((a.stage_id, a.rank) for a in acks) == [(i, 0) for i in sorted(stage_ids)]  # one worker each
    for ack in acks:
        assert ack.status == ACK_SUCCESS and ack.error == "", ack
        assert ack.level == level, ack
        assert ack.freed_bytes > 0, ack  # measured: storage released (CPU) / device memory (GPU)
        assert ack.latency_ms >= 0, ack


def rpc_done(mesh: Mesh, method: str) -> dict[str, int]:
    """How often each service logged `rpc done` for `method` (stage log lines are JSON)."""
    counts: dict[str, int] = {}
    for line in mesh.logs().splitlines():
        if method not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "rpc done" and entry.get("method") == method:
            counts[entry.get("service", "?")] = counts.get(entry.get("service", "?"), 0) + 1
    return counts


def stage_calls(mesh: Mesh, method: str) -> int:
    return sum(n for service, n in rpc_done(mesh, method).items() if service.startswith("stage"))

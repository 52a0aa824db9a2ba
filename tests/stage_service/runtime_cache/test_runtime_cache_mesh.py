"""`stagemesh up` with the runtime-weight cache on stage 1: the stage publishes its final weights
through the mesh's own cache service, which then lists the entry; images are unchanged."""

from __future__ import annotations

import json

import grpc
import pytest

from stagemesh.v1 import cache_pb2, cache_pb2_grpc, gateway_pb2, generation_pb2
from tests.support.meshproc import start_mesh, write_config

pytestmark = pytest.mark.mesh

CACHED_STAGE = """enable_dlo = true
dlo_use_allgather = false
dlo_enable_runtime_cache = true
dlo_checkpoint_mmap = false
"""


@pytest.fixture(scope="module")
def cached_mesh(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("cached-mesh")
    running = start_mesh(write_config(root / "mesh.toml", model_dir, extra_diffusion=CACHED_STAGE), root / "mesh.log")
    yield running
    assert running.stop() == 0


def _cache_address(log: str) -> str:
    for line in log.splitlines():
        if '"child": "cache"' in line and '"event": "serving"' in line:
            return json.loads(line)["address"]
    raise AssertionError("no cache service address in the log")


def _png(mesh, seed: int) -> bytes:
    params = generation_pb2.GenerationParams(prompt="cached", width=64, height=64, num_inference_steps=2, seed=seed)
    with mesh.channel() as channel:
        return (
            mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=120).result.png
        )


def test_stage_publishes_through_the_mesh_cache_service_and_draws_the_same_images(cached_mesh, mesh):
    assert _png(cached_mesh, 5) == _png(mesh, 5)
    with grpc.insecure_channel(_cache_address(cached_mesh.logs())) as channel:
        entries = (
            cache_pb2_grpc.CacheServiceStub(channel).ListEntries(cache_pb2.ListEntriesRequest(), timeout=10).entries
        )
    layouts = [e for e in entries if e.valid and e.tensor_count > 1]
    assert layouts, entries
    assert any(e.live_consumers >= 1 for e in layouts)  # the stage's worker maps it right now
    assert "lock via cache service" in cached_mesh.logs()

"""Compile and step caching through a real `stagemesh up` on a tiny FLUX folder (CPU, random
weights): the diffusion stage compiles its blocks (compile = "regional", which the CPU does not
default to) and runs FirstBlockCache by default; requests choose another cache or none, each result
says how many passes were skipped, and the stage's /metrics add them up. A second start on the same
cache root loads the compiled blocks from disk instead of compiling them.

Random weights say nothing of a cache's image quality: these tests check the plumbing and the
counts, not the pictures.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import grpc
import pytest

from stagemesh import Client
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import Mesh, start_mesh

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

RPC_TIMEOUT_S = 240.0  # the first request compiles on two shared CPU cores
STEPS = 6
BLOCKS = 3  # the tiny FLUX's transformer blocks (write_tiny): what first_block and mag hook
_COUNTER = re.compile(r"^(stagemesh_stage_step_cache_\w+_total)\{[^}]*\} (\S+)$", re.MULTILINE)


def _config(root: Path) -> Path:
    path = root / "mesh.toml"
    path.write_text(f"""
[gateway]
port = 0

[cache]
root = "{root / "cache"}"

[[stages]]
kind = "encoder"
threads = 1

[[stages]]
kind = "diffusion"
threads = 1
compile = "regional"
step_cache = "first_block"
step_cache_threshold = 0.5
metrics_port = 0
""")
    return path


@pytest.fixture(scope="module")
def flux_root(tmp_path_factory) -> tuple[Path, Path]:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny

    root = tmp_path_factory.mktemp("accel")
    return root, write_tiny(root / "flux", "flux")


def _start(root: Path, folder: Path, name: str) -> Mesh:
    return start_mesh(_config(root), root / f"{name}.log", ("--model", str(folder)))


def _generate(mesh: Mesh, **extra) -> generation_pb2.GenerationResult:
    params = generation_pb2.GenerationParams(
        prompt="a red fox", width=32, height=32, num_inference_steps=STEPS, guidance_scale=3.5, seed=7, **extra
    )
    with mesh.channel() as channel:
        reply = mesh.gateway(channel).GenerateUnary(
            gateway_pb2.GenerateUnaryRequest(params=params), timeout=RPC_TIMEOUT_S
        )
    return reply.result


def _counters(mesh: Mesh) -> dict[str, float]:
    address = mesh.metrics_addresses()["stage-1"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return {name: float(value) for name, value in _COUNTER.findall(reply.read().decode())}


def _compiled_ready(mesh: Mesh) -> dict:
    """The stage worker's "compiled blocks ready" log line: its compile counters."""
    lines = [line for line in mesh.logs().splitlines() if '"event": "compiled blocks ready"' in line]
    assert lines, "the diffusion stage never said its compiled blocks were ready"
    return json.loads(lines[-1])


@pytest.mark.mesh
def test_step_cache_counts_reach_results_and_metrics_and_the_compile_cache_outlives_a_restart(flux_root):
    root, folder = flux_root
    mesh = _start(root, folder, "first")
    try:
        stage_default = _generate(mesh)
        assert stage_default.step_cache == "first_block"
        assert stage_default.step_cache_passes == STEPS * BLOCKS
        # The head block always runs; each skipped step skips the other blocks.
        assert stage_default.step_cache_skipped > 0 and stage_default.step_cache_skipped % (BLOCKS - 1) == 0
        uncached = _generate(mesh, step_cache="off")
        assert not uncached.HasField("step_cache_skipped") and uncached.step_cache == ""
        assert uncached.png != stage_default.png
        mag = _generate(mesh, step_cache="mag", step_cache_threshold=0.5)
        assert mag.step_cache == "mag" and mag.step_cache_passes == STEPS * BLOCKS
        with Client(mesh.address, timeout=RPC_TIMEOUT_S) as client:  # the Python client's keywords
            chosen = client.generate(
                "a red fox",
                width=32,
                height=32,
                steps=STEPS,
                guidance_scale=3.5,
                seed=7,
                step_cache="mag",
                step_cache_threshold=0.5,
            )
        counted = (chosen.step_cache, chosen.step_cache_skipped, chosen.step_cache_passes)
        assert counted == ("mag", mag.step_cache_skipped, mag.step_cache_passes)
        assert chosen.bytes == mag.png
        with pytest.raises(grpc.RpcError) as refused:
            _generate(mesh, step_cache="teacache")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "params.step_cache" in (refused.value.details() or "")
        counters = _counters(mesh)
        results = (stage_default, mag, mag)  # the client's request counted as mag's twin
        assert counters["stagemesh_stage_step_cache_skipped_passes_total"] == sum(r.step_cache_skipped for r in results)
        assert counters["stagemesh_stage_step_cache_passes_total"] == sum(r.step_cache_passes for r in results)
        first = _compiled_ready(mesh)
        assert first["compiled"] and first["fxgraph_cache_miss"] > 0
        assert Path(first["cache_dir"]).parent == root / "cache" / "compile"
    finally:
        mesh.stop()
    # A restart on the same node: the compiled blocks come from the disk cache.
    again = _start(root, folder, "second")
    try:
        assert _generate(again).png == stage_default.png
        second = _compiled_ready(again)
        assert second["cache_dir"] == first["cache_dir"]
        assert second["fxgraph_cache_hit"] > 0 and second["fxgraph_cache_miss"] == 0
    finally:
        again.stop()

"""`pip install stagemesh` without extras runs the client, the gateway and the cache service. Here
each runs in a process where torch and the other packages only the stage (or diffusers) extra
brings cannot be imported (tests/support/base_install.py); the gateway draws through the stages of
the session's mesh, which have them."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from PIL import Image

from stagemesh.v1 import cache_pb2, cache_pb2_grpc
from tests.support.base_install import without_stage_extra
from tests.support.meshproc import REPO, spawn_service

RUN_TIMEOUT_S = 120


def stagemesh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagemesh", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def test_torch_cannot_be_imported_there(tmp_path):
    env = without_stage_extra(tmp_path / "site")
    code = "import numpy, PIL, grpc\ntry:\n    import torch.nn\nexcept ModuleNotFoundError as e:\n    print(e.name)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "torch", done.stderr  # the parent package fails first, as when absent


def test_a_stage_says_which_extra_it_needs(tmp_path):
    done = stagemesh(without_stage_extra(tmp_path / "site"), "stage", "--kind", "ar")
    assert done.returncode == 2
    assert "torch is not installed; a stage service needs the stage extra: pip install 'stagemesh[stage]'" in (
        done.stderr
    )


def test_the_cache_service_serves(tmp_path):
    cache = spawn_service(
        "cache", ["cache", "--root", str(tmp_path / "root")], tmp_path, without_stage_extra(tmp_path / "site")
    )
    try:
        with grpc.insecure_channel(cache.wait_bound()) as channel:
            stats = cache_pb2_grpc.CacheServiceStub(channel).GetStats(
                cache_pb2.GetStatsRequest(), timeout=RUN_TIMEOUT_S, wait_for_ready=True
            )
        assert stats.root == str(tmp_path / "root") and stats.entry_count == 0
    finally:
        assert cache.stop() == 0, cache.logs()[-3000:]
    assert "Traceback" not in cache.logs()


@pytest.mark.mesh
def test_the_gateway_and_the_client_serve_an_image(mesh, tmp_path):
    env = without_stage_extra(tmp_path / "site")
    stages = mesh.child_addresses()
    gateway = spawn_service(
        "gateway", ["gateway", "--stage", stages["stage-0"], "--stage", stages["stage-1"]], tmp_path, env
    )
    try:
        address = gateway.wait_bound()
        listed = stagemesh(env, "status", "--address", address)
        assert listed.returncode == 0, listed.stderr
        assert [line.split()[1:3] for line in listed.stdout.splitlines()[1:3]] == [
            ["ar", "serving"],
            ["diffusion", "serving"],
        ], listed.stdout
        out = tmp_path / "out.png"
        drawn = stagemesh(
            env,
            "generate",
            "a lighthouse",
            "--address",
            address,
            "--size",
            "64",
            "--steps",
            "1",
            "--seed",
            "3",
            "-o",
            str(out),
        )
        assert drawn.returncode == 0, drawn.stderr
        with Image.open(out) as image:
            assert (image.format, image.size, image.mode) == ("PNG", (64, 64), "RGB")
    finally:
        assert gateway.stop() == 0, gateway.logs()[-3000:]
    assert "Traceback" not in gateway.logs()

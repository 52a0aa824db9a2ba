"""bench/cold_start.py's CPU smoke mode, run as the lead runs it on a GPU: a fresh diffusers process
and a fresh `stagemesh up --model` on the tiny FLUX folder, each to its second image, with the
mesh's start-up phases read from its log. The page-cache cases are left out: dropping the page
cache would slow every other process on the machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.meshproc import REPO

pytestmark = pytest.mark.mesh

TIMELINE = ("ready_s", "first_image_s", "second_image_s", "launch_to_first_image_s")


def test_cpu_smoke_run_writes_every_figure(tmp_path):
    out = tmp_path / "cold_start.json"
    argv = [sys.executable, "-m", "bench.cold_start", "--preset", "tiny-flux", "--device", "cpu"]
    argv += ["--steps", "2", "--size", "32", "--cases", "diffusers,mesh-hot,mesh-compiled"]
    argv += ["--model-dir", str(tmp_path / "flux"), "--output", str(out)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    for case in ("diffusers", "mesh-hot"):
        assert all(results[case][key] > 0 for key in TIMELINE), results[case]
    phases = {(p["role"], p["phase"]) for p in results["mesh-hot"]["phases"]}
    assert {("up", "start stage-1"), ("stage-1", "workers"), ("stage-1-worker-0", "direct read")} <= phases
    compiled = results["mesh-compiled"]
    assert "skipped" in compiled or all(compiled[key] > 0 for key in TIMELINE)
    # The table names each case, and the phases of the mesh.
    assert "mesh-hot" in done.stdout and "start-up phases of mesh-hot" in done.stdout

"""bench/cold_start.py's CPU smoke mode, run as the lead runs it on a GPU: a fresh diffusers process
and a fresh `stagemesh up --model` on the tiny FLUX folder, each to its second image, with the
mesh's start-up phases read from its log. The page-cache cases are left out: dropping the page
cache would slow every other process on the machine.

The mesh-compiled case is checked without its two meshes: what it runs (a compiling `stagemesh up
--model` on the tiny FLUX folder, then a second start loading the compiled blocks from the same
cache root) is tests/e2e/test_acceleration_mesh.py's restart test; here, that the case asks for
exactly that and reports the warm start beside the first."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import cold_start
from stagemesh.stage_service.settings import StageSettings
from tests.support.meshproc import REPO

TIMELINE = ("ready_s", "first_image_s", "second_image_s", "launch_to_first_image_s")


@pytest.mark.mesh
def test_cpu_smoke_run_writes_every_figure(tmp_path):
    out = tmp_path / "cold_start.json"
    argv = [sys.executable, "-m", "bench.cold_start", "--preset", "tiny-flux", "--device", "cpu"]
    argv += ["--steps", "2", "--size", "32", "--cases", "diffusers,mesh-hot"]
    argv += ["--model-dir", str(tmp_path / "flux"), "--output", str(out)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    for case in ("diffusers", "mesh-hot"):
        assert all(results[case][key] > 0 for key in TIMELINE), results[case]
    phases = {(p["role"], p["phase"]) for p in results["mesh-hot"]["phases"]}
    assert {("up", "start stage-1"), ("stage-1", "workers"), ("stage-1-worker-0", "direct read")} <= phases
    # The table names each case, and the phases of the mesh.
    assert "mesh-hot" in done.stdout and "start-up phases of mesh-hot" in done.stdout


def test_the_compiled_case_starts_twice_on_one_compile_cache_and_reports_both(tmp_path, monkeypatch):
    starts = []

    def mesh_case(folder, args, name, work, cache_root, compiled=False):
        starts.append((name, cache_root, compiled))
        return {key: float(len(starts)) for key in TIMELINE}

    monkeypatch.setattr(cold_start, "mesh_case", mesh_case)
    result = cold_start.run_case("mesh-compiled", tmp_path / "flux", SimpleNamespace(), tmp_path)
    root = tmp_path / "compile-cache"
    assert starts == [("mesh-compile-first", root, True), ("mesh-compiled", root, True)]
    assert result == {**{key: 2.0 for key in TIMELINE}, "first_start_on_fresh_node": {key: 1.0 for key in TIMELINE}}
    # The warm start is the one measured against the target.
    verdict = cold_start.verdicts({"mesh-hot": {"launch_to_first_image_s": 20.0}, "mesh-compiled": result})
    assert verdict["warm_launch_to_first_image"]["case"] == "mesh-compiled"


@pytest.mark.parametrize("compiled", [True, False])
def test_the_compiled_mesh_compiles_its_diffusion_stage_into_the_cases_cache_root(tmp_path, compiled):
    path = cold_start.mesh_config(tmp_path / "mesh.toml", "cpu", 32, tmp_path / "root", compiled)
    config = tomllib.loads(path.read_text())
    assert config["cache"]["root"] == str(tmp_path / "root")
    encoder, diffusion = (StageSettings.from_mapping(table) for table in config["stages"])
    assert (encoder.kind, encoder.compile_mode(), diffusion.kind) == ("encoder", "off", "diffusion")
    assert diffusion.compile_mode() == ("regional" if compiled else "off")
    if compiled:
        assert Path(diffusion.dlo_runtime_cache_dir) == tmp_path / "root"

"""Start-up: the phases every process logs, the stage's start-up report, and the first-image
warm-up, on real meshes (`stagemesh up`) of the embedded tiny model.

The ordering is read from what the processes say, not from clocks: a worker's phases reach its
stage inside its Ready message, so a warm-up phase in the stage's report was over before the
worker said it was ready, and the stage reports ready only after every worker has."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stagemesh.core import startup
from tests.support.meshproc import REPO, start_mesh, unary_png, write_config

pytestmark = pytest.mark.mesh

START_TIMEOUT_S = 180


def log_events(text: str, event: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if f'"event": "{event}"' in line:
            out.append(json.loads(line))
    return out


def stage_report(text: str, stage_id: int) -> dict:
    [report] = [r for r in log_events(text, startup.REPORT_EVENT) if r.get("stage_id") == stage_id]
    return report


@pytest.fixture(scope="module")
def warm_mesh(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("warm")
    config = write_config(
        root / "mesh.toml", model_dir, extra_stage='warm_up = "on"', extra_diffusion="default_size = 64"
    )
    mesh = start_mesh(config, root / "mesh.log")
    yield mesh
    mesh.stop()


def test_each_stage_reports_ready_only_after_its_workers_warm_up(warm_mesh):
    text = warm_mesh.logs()
    for stage_id in (0, 1):
        phases = stage_report(text, stage_id)["phases"]
        worker = [p["phase"] for p in phases if p["role"] == f"stage-{stage_id}-worker-0"]
        # In the order the worker went through them, the warm-up last: then came Ready.
        assert worker[-4:] == ["model load", "acceleration", "sleep and output set-up", "warm-up"], worker
        own = {p["phase"]: p for p in phases if p["role"] == f"stage-{stage_id}"}
        assert list(own) == [startup.PROCESS_PHASE, "model folder", "stage imports", "workers"]
        # The workers were spawned before the stage imported its server, not after.
        assert own["workers"]["at"] <= own["stage imports"]["at"]
    [warm] = [p for p in stage_report(text, 1)["phases"] if p["phase"] == "warm-up"]
    assert (warm["size"], warm["steps"]) == (64, 2)
    assert unary_png(warm_mesh, 64, 64, steps=4, seed=3, prompt="a red circle").startswith(b"\x89PNG")


def test_up_logs_each_child_start_and_one_report(warm_mesh):
    text = warm_mesh.logs()
    ups = [p for p in log_events(text, startup.PHASE_EVENT) if p["role"] == "up"]
    assert {p["phase"] for p in ups} == {
        startup.PROCESS_PHASE,
        "start cache",
        "start stage-0",
        "start stage-1",
        "start gateway",
    }
    [report] = [r for r in log_events(text, startup.REPORT_EVENT) if r["role"] == "up"]
    assert report["ready_s"] > 0 and report["children"] == 4
    # The gateway starts once the stages have bound their ports, while they still load.
    starts = {p["phase"]: p for p in ups}
    assert starts["start gateway"]["at"] >= starts["start stage-1"]["at"]


def test_no_warm_up_on_a_cpu_stage_by_default(mesh):
    phases = [p["phase"] for p in log_events(mesh.logs(), startup.PHASE_EVENT)]
    assert "model load" in phases and "warm-up" not in phases


def test_a_failed_warm_up_fails_the_start_naming_why(tmp_path, model_dir):
    """default_size 72 is not a multiple of the tiny DiT's pixel multiple: every request that
    leaves the size unset would fail, so the warm-up refuses the start and says what to set."""
    config = write_config(tmp_path / "mesh.toml", model_dir, extra_diffusion='warm_up = "on"\ndefault_size = 72')
    done = subprocess.run(
        [sys.executable, "-m", "stagemesh", "up", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("stagemesh: stage-1 exited with code 1 before it was serving"), last
    assert "warm-up (72x72, 2 steps): default_size 72 is not a multiple of the model's pixel multiple" in last
    assert "warm_up = 'off'" in last

"""bench/families.py's CPU smoke mode runs end to end: a tiny folder of a family through a real
mesh and through diffusers' own pipeline, its JSON saying the PNG bytes are equal and the folder
gone after the family's run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.meshproc import REPO

pytest.importorskip("transformers")
pytest.importorskip("diffusers")


@pytest.mark.mesh
def test_cpu_smoke_run_reports_equal_bytes(tmp_path):
    out = tmp_path / "families.json"
    command = [
        sys.executable,
        "-m",
        "bench.families",
        "--preset",
        "tiny-folders",
        "--device",
        "cpu",
        "--families",
        "zimage",
        "--cases",
        "diffusers-resident,mesh-resident,mesh-dlo,mesh-dlo-int8",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--output",
        str(out),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())["families"]["zimage"]
    assert result["same_png"] == {"mesh-resident == diffusers-resident": True}
    assert result["psnr_db"]["mesh-dlo-int8"] > 30
    assert set(result["results"]) == {"diffusers-resident", "mesh-resident", "mesh-dlo", "mesh-dlo-int8"}
    assert "zimage mesh_vs_diffusers_resident" in done.stdout

"""A service that cannot start as configured exits with one log line naming the cause and no
traceback: 2 for a refused option (an incomplete model folder, an unreadable token file, no
--stage), 1 for a start that failed (a folder that cannot be created). An unexpected exception is
a bug and keeps its traceback in the log."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.meshproc import REPO

START_TIMEOUT_S = 60


def _folder_without_vae(root: Path) -> Path:
    """A diffusers folder whose model_index.json lists a 'vae' that is absent; the other
    components a diffusion stage needs are present, so the vae is what the stage refuses."""
    root.mkdir()
    (root / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "FluxPipeline",
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "transformer": ["diffusers", "FluxTransformer2DModel"],
                "vae": ["diffusers", "AutoencoderKL"],
            }
        )
    )
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    (root / "transformer").mkdir()
    (root / "transformer" / "config.json").write_text("{}")
    (root / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    return root


def _blocked_path(tmp_path: Path) -> Path:
    """A path below a regular file: nothing can be created there."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "below"


def _start(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagemesh", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _last_log_line(stderr: str) -> dict:
    return json.loads(stderr.strip().splitlines()[-1])


def _assert_refused(done: subprocess.CompletedProcess, code: int, service: str, *names: str) -> None:
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    last = _last_log_line(done.stderr)
    assert (last["level"], last["event"]) == ("error", f"{service} failed to start"), last
    for name in names:
        assert name in last["reason"], last


def test_stage_with_a_folder_missing_its_vae_exits_2_naming_it(tmp_path):
    folder = _folder_without_vae(tmp_path / "no-vae")
    done = _start("stage", "--kind", "diffusion", "--model-dir", str(folder), "--port", "0")
    _assert_refused(done, 2, "stage service", "missing component 'vae'", str(folder / "vae"))


def test_stage_with_an_unreadable_token_file_exits_2_naming_the_option(tmp_path):
    missing = tmp_path / "no-token"
    done = _start("stage", "--token-file", str(missing), "--port", "0")
    _assert_refused(done, 2, "stage service", "--token-file", str(missing))


def test_stage_whose_model_folder_cannot_be_created_exits_1_naming_the_path(tmp_path):
    blocked = _blocked_path(tmp_path)
    done = _start("stage", "--kind", "diffusion", "--model-dir", str(blocked), "--port", "0")
    _assert_refused(done, 1, "stage service", str(blocked.parent))


def test_gateway_without_stages_exits_2_naming_the_option():
    done = _start("gateway", "--port", "0")
    _assert_refused(done, 2, "gateway", "--stage")


def test_cache_whose_root_cannot_be_created_exits_1_naming_it(tmp_path):
    blocked = _blocked_path(tmp_path)
    done = _start("cache", "--root", str(blocked), "--port", "0")
    _assert_refused(done, 1, "cache service", f"cache root {blocked}")


@pytest.mark.parametrize(
    "error,code,traceback",
    [
        ("RuntimeError('a bug')", 1, True),  # unexpected: its traceback is what finds the bug
        ("PermissionError(13, 'Permission denied', '/srv/weights')", 1, False),
    ],
)
def test_only_unexpected_errors_keep_their_traceback(error, code, traceback):
    program = textwrap.dedent(f"""
        from stagemesh.core import logs, serve

        async def service():
            raise {error}

        logs.configure("probe")
        serve.main("probe", service())
    """)
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False
    )
    assert done.returncode == code, done.stderr
    assert ("Traceback" in done.stderr) is traceback, done.stderr
    last = _last_log_line(done.stderr)
    assert last["level"] == "error", last
    if traceback:
        assert last["event"] == "probe failed" and "RuntimeError: a bug" in last["exception"], last
    else:
        assert last["event"] == "probe failed to start" and "/srv/weights" in last["reason"], last


def test_a_refused_option_combination_exits_2_naming_the_option():
    done = _start("stage", "--kind", "diffusion", "--enable-dlo", "--dlo-resident-layers", "-1", "--port", "0")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("stagemesh stage: error:") and "resident" in done.stderr


def test_a_corrupt_checkpoint_fails_the_start_without_a_traceback(tmp_path):
    from stagemesh.stage_service.models.config import PipelineConfig
    from stagemesh.stage_service.models.weights import DIT_FILE, ensure_model_dir

    broken = ensure_model_dir(tmp_path / "model", PipelineConfig.tiny())
    (broken / DIT_FILE).write_bytes((broken / DIT_FILE).read_bytes()[:64])
    done = _start("stage", "--kind", "diffusion", "--model-dir", str(broken), "--port", "0")
    _assert_refused(done, 1, "stage service", str(DIT_FILE))

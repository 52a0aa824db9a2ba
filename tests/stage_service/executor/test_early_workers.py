"""Workers spawned at the stage's start (executor.early, stage_service/entry.py) with real
processes: the executor adopts them, their read-ahead overlaps their imports (read from the
phases they report), what no executor adopted is killed, and a stage stopped while its workers
still load exits cleanly. No GPU, nothing faked."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from stagemesh.stage_service.executor.early import EarlyWorkers
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.worker import read_ahead
from tests.support.meshproc import alive, descendants, segments_of, shm_entries, spawn_service
from tests.support.shm_guard import no_segment_left_behind  # noqa: F401 - autouse fixture

WAIT_S = 120.0
# A phase's `at` and `seconds` are each rounded to the millisecond: its end as read back may
# pass the next phase's start by up to that much.
ROUNDING_S = 0.002


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory) -> Path:
    pytest.importorskip("diffusers")
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny

    return write_tiny(tmp_path_factory.mktemp("early") / "flux", "flux")


def _settings(model_dir: Path, kind: str = "diffusion") -> StageSettings:
    return StageSettings(stage_id=1, kind=kind, model_dir=str(model_dir), device="cpu", threads=1)


def _ends(phase: dict) -> float:
    return phase["at"] + phase["seconds"]


def test_adopted_workers_read_their_checkpoint_while_they_import(flux_folder):
    settings = _settings(flux_folder)
    early = EarlyWorkers(settings)
    pids = [w.process.pid for g in early.groups for w in g.workers]
    executor = Executor(settings, spawned=early.take())
    try:
        [ready] = executor.start(timeout_s=WAIT_S)
        assert [w.process.pid for g in executor.groups for w in g.workers] == pids  # none spawned again
    finally:
        executor.shutdown()
        early.close()  # adopted: the executor's to stop, nothing left to do
    phases = {p["phase"]: p for p in ready.phases}
    ahead, imports = phases[read_ahead.PHASE], phases["worker imports"]
    # The read began before the imports did, so it overlapped them; it read every byte of the
    # transformer's and the VAE's files (the components a diffusion stage loads).
    assert ahead["at"] <= imports["at"] < _ends(imports) <= phases["model imports"]["at"] + ROUNDING_S, phases
    files = read_ahead.checkpoint_files("diffusion", flux_folder)
    assert ahead["bytes"] == sum(f.stat().st_size for f in files) and ahead["complete"]
    # The load came after the imports: diffusers' classes in their own phase, then the read.
    assert _ends(phases["model imports"]) <= phases["model load"]["at"] + ROUNDING_S, phases
    assert not any(alive(pid) for pid in pids)


def test_workers_no_executor_adopted_are_killed_by_close(tiny_model):
    early = EarlyWorkers(_settings(tiny_model))
    processes = [w.process for g in early.groups for w in g.workers]
    assert processes and all(p.is_alive() for p in processes)
    early.close()
    assert all(p.exitcode is not None for p in processes)
    assert all(g.workers == [] for g in early.groups)


def test_a_stage_stopped_while_its_workers_load_exits_cleanly(tmp_path, flux_folder):
    args = ["stage", "--stage-id", "1", "--kind", "diffusion", "--model-dir", str(flux_folder), "--threads", "1"]
    stage = spawn_service("stage-1", [*args, "--device", "cpu"], tmp_path)
    deadline = time.monotonic() + WAIT_S
    while not (workers := descendants(stage.process.pid)):
        assert stage.process.poll() is None and time.monotonic() < deadline, stage.logs()[-3000:]
        time.sleep(0.02)
    # The worker exists before the stage has imported its server: stop it now, mid-start.
    stage.process.send_signal(signal.SIGTERM)
    assert stage.process.wait(WAIT_S) == 0, stage.logs()[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in workers)
    assert not segments_of(shm_entries(), [stage.process.pid, *workers])


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def test_early_workers_inherit_the_stages_token_and_ca(tmp_path, tiny_model):
    """Workers publish to the cache service with the stage's token and CA, which they inherit
    through the environment: spawned before the stage's server, they must still get both."""
    from stagemesh.core import auth, tls
    from tests.core.test_security import make_certificates

    pki = make_certificates(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("a-stage-token\n")
    args = ["stage", "--stage-id", "1", "--kind", "diffusion", "--model-dir", str(tiny_model), "--threads", "1"]
    args += ["--device", "cpu", f"--token-file={token_file}", f"--tls-ca={pki['ca']}"]
    stage = spawn_service("stage-1", args, tmp_path)
    try:
        deadline = time.monotonic() + WAIT_S
        while not (workers := [p for p in descendants(stage.process.pid) if "spawn_main" in _cmdline(p)]):
            assert stage.process.poll() is None and time.monotonic() < deadline, stage.logs()[-3000:]
            time.sleep(0.02)
        env = _environ(workers[0])
        assert env.get(auth.TOKEN_ENV) == "a-stage-token"
        assert env.get(tls.CA_ENV) == str(Path(pki["ca"]).resolve())
    finally:
        assert stage.stop() == 0, stage.logs()[-3000:]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

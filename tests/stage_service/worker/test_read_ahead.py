"""The worker's read-ahead of its checkpoint (worker/read_ahead.py) on real files: what it lists
for each stage kind, that it reads every byte once and records its phase, its memory bound, and
that a failure names the file and leaves no thread behind."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from stagemesh.core import startup
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.worker import read_ahead
from stagemesh.stage_service.worker.read_ahead import ReadAhead, ReadAheadFailed


def _threads_left() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("read-ahead-")]


def _file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def test_reads_every_byte_and_records_its_phase(tmp_path):
    files = [_file(tmp_path / f"f{i}.safetensors", size) for i, size in enumerate((1, 100_003, 3 << 20, 0))]
    ahead = ReadAhead(files, threads=3, piece_bytes=64 << 10).start()
    assert ahead.wait(60)
    entry = ahead.stop()
    assert entry is not None and entry["phase"] == read_ahead.PHASE
    total = sum(f.stat().st_size for f in files)
    assert (entry["bytes"], entry["planned"], entry["files"], entry["complete"]) == (total, total, 4, True)
    assert entry in startup.records()
    assert ahead.stop() is None  # recorded once
    assert _threads_left() == []


def test_the_memory_budget_bounds_what_is_read(tmp_path):
    files = [_file(tmp_path / "a", 5 << 20), _file(tmp_path / "b", 5 << 20)]
    ahead = ReadAhead(files, piece_bytes=1 << 20, budget_bytes=7 << 20).start()
    assert ahead.wait(60)
    entry = ahead.stop()
    assert entry is not None and entry["bytes"] == entry["planned"] == 7 << 20 and entry["complete"]


def test_a_file_that_cannot_be_read_fails_naming_it(tmp_path):
    good = _file(tmp_path / "good.safetensors", 1 << 20)
    bad = tmp_path / "bad.safetensors"
    bad.mkdir()  # opens, but reading it fails (EISDIR), as an I/O error would
    ahead = ReadAhead([good, bad], threads=2, piece_bytes=1 << 16).start()
    assert ahead.wait(60)
    entry = ahead.stop()
    assert entry is not None and not entry["complete"] and str(bad) in entry["error"]
    with pytest.raises(ReadAheadFailed, match=str(bad)):
        ahead.raise_if_failed()
    assert _threads_left() == []


def test_a_file_that_shrank_fails_naming_where_it_ended(tmp_path):
    path = _file(tmp_path / "model.safetensors", 2 << 20)
    ahead = ReadAhead([path], threads=1, piece_bytes=1 << 20)
    os.truncate(path, (1 << 20) + 10)
    assert ahead.start().wait(60)
    ahead.stop()
    with pytest.raises(ReadAheadFailed, match=f"{path}: file ended at byte {(1 << 20) + 10}"):
        ahead.raise_if_failed()


def test_stop_ends_a_read_ahead_midway_and_joins_its_threads(tmp_path):
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as f:
        f.truncate(4 << 30)  # sparse: reads are quick, but not 4 GiB before stop() in 4 KiB pieces
    ahead = ReadAhead([path], threads=2, piece_bytes=4 << 10).start()
    entry = ahead.stop()
    assert entry is not None and not entry["complete"] and entry["bytes"] < entry["planned"]
    assert _threads_left() == []


def test_lists_the_files_each_kind_of_a_diffusers_stage_loads(tmp_path):
    pytest.importorskip("diffusers")
    from stagemesh.stage_service.models.diffusers_adapter import open_folder
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny

    folder = open_folder(write_tiny(tmp_path / "flux", "flux"))

    def names(kind: str) -> set[str]:
        return {str(p.relative_to(folder.path).parent) for p in read_ahead.checkpoint_files(kind, folder.path)}

    assert names("diffusion") == names("denoise") == {"transformer", "vae"}
    assert names("decode") == {"vae"}
    assert names("encoder") == {"text_encoder", "text_encoder_2"}
    files = read_ahead.checkpoint_files("diffusion", folder.path)
    assert files == [*folder.weight_files("transformer"), *folder.weight_files("vae")]


def test_lists_the_embedded_models_files_and_starts_only_when_on(tmp_path):
    lm = _file(tmp_path / "lm" / "model.safetensors", 1000)
    dit = _file(tmp_path / "dit" / "model.safetensors", 2000)
    assert read_ahead.checkpoint_files("ar", tmp_path) == [lm]
    assert read_ahead.checkpoint_files("diffusion", tmp_path) == [dit]
    on = StageSettings(kind="diffusion", model_dir=str(tmp_path))
    ahead = read_ahead.start_for(on, tmp_path)
    assert ahead is not None and ahead.wait(60)
    entry = ahead.stop()
    assert entry is not None and entry["bytes"] == 2000
    off = StageSettings(kind="diffusion", model_dir=str(tmp_path), read_ahead=False)
    assert read_ahead.start_for(off, tmp_path) is None


def test_a_folder_it_cannot_list_leaves_the_judgement_to_the_load(tmp_path):
    """A diffusers folder whose model_index.json is broken, or a folder that is not there: no
    read-ahead and no thread; the load then fails naming what is wrong."""
    (tmp_path / "model_index.json").write_text("{not json")
    assert read_ahead.start_for(StageSettings(kind="diffusion", model_dir=str(tmp_path)), tmp_path) is None
    assert (
        read_ahead.start_for(StageSettings(kind="diffusion", model_dir=str(tmp_path / "absent")), tmp_path / "absent")
        is None
    )
    assert _threads_left() == []

"""The checkpoint a level-2 wake reads (worker/checkpoint_source.py), through SleepController on
the real tiny model, on the CPU: held across cycles in the modes that prepare ahead (locked once,
unlocked once), locked and let go per wake in "first_sleep", and never read through a mapping of
a file that has since been replaced or rewritten on disk.

No CUDA device here: `platform.lock_host_range` is replaced by a recorder of what would have been
page-locked (the driver is what cannot exist here); the files, mappings, threads and copies are
real. The checkpoint is a copy of the tiny model's, so a test may replace it.
"""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

import pytest
import torch

from stagemesh.stage_service import platform
from stagemesh.stage_service.models.contract import WeightFile
from stagemesh.stage_service.models.runners import DiffusionRunner
from stagemesh.stage_service.models.weights import DIT_FILE
from stagemesh.stage_service.worker import checkpoint_source
from stagemesh.stage_service.worker.reload import CheckpointChanged
from stagemesh.stage_service.worker.sleep import SleepController
from stagemesh.weight_store.checkpoint import read_index

PIECE = 4 * mmap.PAGESIZE  # small pieces: the tiny checkpoint spans dozens of them
CYCLES = 20
HELD = ["at_start", "background"]

Range = tuple[int, int]  # (address, bytes) of a locked range


class Locks:
    """Stands in for cudaHostRegister: every range locked, and every undo, in order."""

    def __init__(self) -> None:
        self.locked: list[tuple[int, int, bool]] = []
        self.unlocked: list[tuple[int, int, bool]] = []

    def __call__(self, ptr: int, nbytes: int, device, read_only: bool = False):
        key = (ptr, nbytes, read_only)
        self.locked.append(key)
        return lambda: self.unlocked.append(key)

    def checkpoint(self, which: list[tuple[int, int, bool]]) -> list[Range]:
        """The ranges of the checkpoint mapping (locked read-only; the level-1 buffer is writable)."""
        return [(ptr, n) for ptr, n, read_only in which if read_only]


@pytest.fixture
def locks(monkeypatch) -> Locks:
    recorder = Locks()
    monkeypatch.setattr(platform, "lock_host_range", recorder)
    return recorder


@pytest.fixture
def diffusion(tiny_model) -> DiffusionRunner:
    return DiffusionRunner(tiny_model, "cpu")


@pytest.fixture
def files(tmp_path, tiny_model, diffusion) -> list[WeightFile]:
    path = tmp_path / Path(DIT_FILE).name
    shutil.copyfile(tiny_model / DIT_FILE, path)
    # Written long ago, as a checkpoint is: a rewrite within the same tick of the file system's
    # clock as the last write would keep its modification time.
    os.utime(path, ns=(0, 0))
    return [WeightFile(path, diffusion.weight_files()[0].parts)]


def _state(files: list[WeightFile]) -> dict[str, bytes]:
    return {
        prefix + name: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for wf in files
        for prefix, module in wf.parts.items()
        for name, t in module.state_dict().items()
    }


def _new_version(path: Path) -> tuple[bytes, dict[str, bytes]]:
    """The checkpoint at `path` with every floating tensor changed and the layout kept (the same
    header, the same offsets: only the version on disk tells it from the old one), and the new
    bytes of each tensor."""
    data = bytearray(path.read_bytes())
    tensors = {}
    for key, r in read_index(path).items():
        view = torch.frombuffer(data, dtype=torch.uint8, count=r.nbytes, offset=r.file_offset)
        t = view.view(r.dtype)
        if t.is_floating_point():
            t.copy_(t * 2 + 1)
        tensors[key] = view.numpy().tobytes()
    return bytes(data), tensors


def _replace(path: Path, data: bytes) -> None:
    """A new version renamed over the path, as a publisher installs one (a new inode)."""
    fresh = path.with_suffix(".new")
    fresh.write_bytes(data)
    os.replace(fresh, path)


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """A new version written into the same inode (truncated and rewritten)."""
    inode = path.stat().st_ino
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)
    assert path.stat().st_ino == inode


def _expect(tensors: dict[str, bytes], files: list[WeightFile]) -> dict[str, bytes]:
    return {k: tensors[k] for k in _state(files)}


# ---- held across cycles ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", HELD)
def test_a_held_checkpoint_is_locked_once_over_twenty_cycles_and_unlocked_once_on_close(files, locks, mode):
    before = _state(files)
    controller = SleepController(files, "cpu", host_buffer=mode, piece_bytes=PIECE)
    assert locks.checkpoint(locks.locked) == [] and controller.checkpoint_bytes == 0  # nothing before level 2
    first: list[Range] = []
    for cycle in range(CYCLES):
        level = 2 - cycle % 2  # level 2 first: it maps and locks
        controller.sleep(level)
        controller.wake()
        if cycle == 0:
            first = locks.checkpoint(locks.locked)
            assert len(first) > 10 and len(set(first)) == len(first)  # every piece, each once
            assert controller.checkpoint_bytes == sum(n for _, n in first)
        assert _state(files) == before, cycle
    assert locks.checkpoint(locks.locked) == first  # no piece locked again in 19 more cycles
    assert locks.checkpoint(locks.unlocked) == []  # nor let go while held
    stats = controller.fill_stats()
    assert (stats["held"], stats["runs"], stats["lock_calls"], stats["staged_bytes"]) == (1, CYCLES // 2, len(first), 0)
    controller.close()
    assert sorted(locks.checkpoint(locks.unlocked)) == sorted(first)  # each exactly once
    controller.close()
    assert len(locks.checkpoint(locks.unlocked)) == len(first)
    assert controller.checkpoint_bytes == 0 and controller.host_bytes == 0


def test_the_first_level_2_sleep_starts_the_locking_and_the_wake_only_copies(files, locks):
    controller = SleepController(files, "cpu", host_buffer="background", piece_bytes=PIECE)
    controller.sleep(2)
    held = controller._checkpoint._kept  # what the sleep started: the pieces lock while it sleeps
    assert held is not None
    for f in held._files:
        f.pieces.wait()
    locked = locks.checkpoint(locks.locked)
    assert locked and controller.checkpoint_bytes == sum(n for _, n in locked)
    controller.wake()
    assert locks.checkpoint(locks.locked) == locked  # the wake locked nothing more
    assert controller.fill_stats()["runs"] == 1
    controller.close()


def test_a_level_1_sleep_made_deeper_holds_the_checkpoint_too(files, locks):
    before = _state(files)
    controller = SleepController(files, "cpu", host_buffer="at_start", piece_bytes=PIECE)
    controller.sleep(1)
    controller.sleep(2)
    assert controller.host_bytes > 0 and controller.checkpoint_bytes > 0  # both held while asleep
    controller.wake()
    assert _state(files) == before
    controller.close()
    assert sorted(locks.unlocked) == sorted(locks.locked)  # the buffer's and the checkpoint's, each once


def test_first_sleep_mode_locks_per_wake_and_holds_nothing_between(files, locks):
    before = _state(files)
    controller = SleepController(files, "cpu", piece_bytes=PIECE)
    per_wake: list[Range] = []
    for cycle in range(3):
        controller.sleep(2)
        assert controller.checkpoint_bytes == 0
        controller.wake()
        controller.settle()
        locked = locks.checkpoint(locks.locked)
        if cycle == 0:
            per_wake = list(locked)
        assert len(locked) == (cycle + 1) * len(per_wake)  # every wake locks every piece again
        assert sorted(locks.checkpoint(locks.unlocked)) == sorted(locked)  # and let go of them
        assert controller.fill_stats()["held"] == 0 and controller.checkpoint_bytes == 0
    assert _state(files) == before


# ---- a checkpoint changed on disk -----------------------------------------------------------------
@pytest.mark.parametrize("change", [_replace, _rewrite_in_place], ids=["renamed-over", "rewritten-in-place"])
@pytest.mark.parametrize("when", ["asleep", "awake"])
def test_a_held_checkpoint_changed_on_disk_is_mapped_again_never_read_stale(files, locks, change, when):
    path = Path(files[0].path)
    controller = SleepController(files, "cpu", host_buffer="at_start", piece_bytes=PIECE)
    controller.sleep(2)
    controller.wake()  # held from here on
    old = locks.checkpoint(locks.locked)
    data, new = _new_version(path)
    if when == "awake":
        change(path, data)
        controller.sleep(2)  # sees the change: maps the new file while asleep
    else:
        controller.sleep(2)
        change(path, data)  # the wake sees it
    controller.wake()
    assert _state(files) == _expect(new, files)
    assert sorted(locks.checkpoint(locks.unlocked)) == sorted(old)  # the old mapping let go, once
    fresh = locks.checkpoint(locks.locked)[len(old) :]
    assert len(fresh) == len(old)  # the new one locked, once
    controller.sleep(2)
    controller.wake()  # and kept from then on
    assert len(locks.checkpoint(locks.locked)) == 2 * len(old)
    assert _state(files) == _expect(new, files)
    controller.close()
    assert sorted(locks.checkpoint(locks.unlocked)) == sorted(old + fresh)


def test_a_checkpoint_replaced_while_the_wake_reads_its_index_fails_the_wake_which_can_be_repeated(
    files, locks, monkeypatch
):
    path = Path(files[0].path)
    controller = SleepController(files, "cpu", host_buffer="at_start", piece_bytes=PIECE)
    controller.sleep(2)
    controller.wake()
    controller.sleep(2)
    data, new = _new_version(path)
    real_read_index = checkpoint_source.read_index
    calls = []

    def read_then_replace(p):
        index = real_read_index(p)
        if not calls:
            _replace(path, data)  # lands between the index and the check after it
        calls.append(p)
        return index

    monkeypatch.setattr(checkpoint_source, "read_index", read_then_replace)
    with pytest.raises(CheckpointChanged, match="replaced"):
        controller.wake()
    assert controller.level == 2  # still asleep: nothing was copied from either version
    assert controller.checkpoint_bytes == 0  # the old mapping was let go
    assert sorted(locks.checkpoint(locks.unlocked)) == sorted(locks.checkpoint(locks.locked))
    controller.wake()
    assert controller.level == 0 and _state(files) == _expect(new, files)
    controller.close()


def test_a_held_checkpoint_deleted_on_disk_fails_the_wake_and_is_let_go(files, locks):
    path = Path(files[0].path)
    controller = SleepController(files, "cpu", host_buffer="at_start", piece_bytes=PIECE)
    controller.sleep(2)
    controller.wake()
    controller.sleep(2)
    kept = path.read_bytes()
    path.unlink()
    with pytest.raises(FileNotFoundError):
        controller.wake()  # what the file at the path holds is what a level-2 wake loads: there is none
    assert controller.level == 2 and controller.checkpoint_bytes == 0
    assert sorted(locks.checkpoint(locks.unlocked)) == sorted(locks.checkpoint(locks.locked))
    path.write_bytes(kept)
    controller.wake()
    assert controller.level == 0
    controller.close()


def test_a_checkpoint_that_cannot_be_read_at_sleep_does_not_fail_the_sleep(files, locks):
    path = Path(files[0].path)
    controller = SleepController(files, "cpu", host_buffer="at_start", piece_bytes=PIECE)
    kept = path.read_bytes()
    path.unlink()
    slept = controller.sleep(2)  # holding only saves time: the sleep stands
    assert slept.level == 2 and controller.checkpoint_bytes == 0
    path.write_bytes(kept)
    controller.wake()  # maps it now, and keeps it
    assert controller.level == 0 and controller.fill_stats()["held"] == 1
    controller.close()


# ---- components whose files store the same keys ---------------------------------------------------
def _expert(path: Path, seed: int) -> WeightFile:
    """A component saved in its own file (Wan 2.2's two experts: the same class, so the same
    keys, in transformer/ and transformer_2/)."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    path.parent.mkdir(parents=True)
    save_file(module.state_dict(), str(path))
    return WeightFile(path, {"": module})


@pytest.mark.parametrize("held", [False, True])
def test_each_file_fills_its_own_tensors_when_two_files_store_the_same_keys(tmp_path, locks, held):
    files = [
        _expert(tmp_path / "transformer" / "w.safetensors", 1),
        _expert(tmp_path / "transformer_2" / "w.safetensors", 2),
    ]
    wanted, offset = [], 0
    for wf in files:
        for key, t in wf.parts[""].state_dict().items():
            nbytes = t.numel() * t.element_size()
            wanted.append(checkpoint_source.Wanted(Path(wf.path), key, tuple(t.shape), t.dtype, offset, nbytes))
            offset += nbytes
    source = checkpoint_source.CheckpointSource(files, wanted, torch.device("cpu"), PIECE, held=held)
    flat = torch.full((offset,), 0xAB, dtype=torch.uint8)  # no byte of it is a tensor's: each must be filled
    source.fill(flat)
    source.settle()
    for w, wf in zip(wanted, [f for f in files for _ in f.parts[""].state_dict()], strict=True):
        stored = wf.parts[""].state_dict()[w.key].reshape(-1).view(torch.uint8)
        assert torch.equal(flat[w.offset : w.offset + w.nbytes], stored), f"{w.key} of {w.path}"
    source.close()


def test_a_level_2_wake_gives_each_component_its_own_weights_when_their_keys_are_the_same(tmp_path, locks):
    files = [
        _expert(tmp_path / "transformer" / "w.safetensors", 1),
        _expert(tmp_path / "transformer_2" / "w.safetensors", 2),
    ]
    before = [{k: t.clone() for k, t in wf.parts[""].state_dict().items()} for wf in files]
    assert not torch.equal(before[0]["0.weight"], before[1]["0.weight"])
    controller = SleepController(files, "cpu", piece_bytes=PIECE)
    controller.sleep(2)
    controller.wake()
    for wf, state in zip(files, before, strict=True):
        for key, t in wf.parts[""].state_dict().items():
            assert torch.equal(t, state[key]), f"{key} of {wf.path}"
    controller.close()

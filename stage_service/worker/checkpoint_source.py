"""Where level-2 wakes read the weights from: the checkpoint files, page-locked in place.

`per_wake`: every wake maps the files, locks the pieces the weights lie in while it copies from
the ones already locked (`reload.MappedFill`), and lets go on a thread after it returns: nothing
is held between wakes, and each wake pays for the locking.

`held`: the first level-2 sleep maps the files and starts locking on threads while the stage
sleeps (`hold()`); the mapping and its locks are kept across cycles, so every later wake is pure
DMA from page-locked page cache, which the kernel cannot evict while it is held (the size of the
weights). Every wake first reads each file's index and version (`checkpoint.file_version`); a
file replaced or rewritten since it was mapped is never read through the old mapping: the held
fill is closed and the file mapped and locked afresh. A file that changes while its index is
read, or between that and its mapping, fails the wake with `CheckpointChanged` (the stage stays
asleep; waking again reads the new file).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from stagemesh.core import logs
from stagemesh.stage_service.models.contract import WeightFile
from stagemesh.stage_service.worker.host_pages import Warm
from stagemesh.stage_service.worker.reload import CheckpointChanged, Copy, MappedFill, Reloader
from stagemesh.weight_store.checkpoint import FileVersion, file_version, read_index

log = logs.get_logger("stagemesh.worker.sleep")


@dataclass(frozen=True)
class Wanted:
    """A checkpoint tensor a wake reloads: the file it is read from (two components of one
    stage, e.g. Wan 2.2's two experts, store the same keys in their own files), and where it
    goes in the device buffer."""

    path: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


class CheckpointSource:
    """Level-2 wakes of `wanted` (by file and checkpoint key) from `files`; `held`: keep the mapping and
    its locks across wakes (see the module). `warm` makes the WarmDma a mapping locked ahead of
    its first wake is warmed with (or None)."""

    def __init__(
        self,
        files: list[WeightFile],
        wanted: list[Wanted],
        device: torch.device,
        piece_bytes: int,
        held: bool,
        warm: Callable[[], Warm | None] = lambda: None,
    ):
        self.files = files
        self.held = held
        self._wanted = {(Path(w.path), w.key): w for w in wanted}
        self._device = device
        self._piece_bytes = piece_bytes
        self._warm = warm
        self._reloader = Reloader(device)  # for pieces the driver will not lock
        self._kept: MappedFill | None = None  # held mode: the mapping kept across wakes
        self._last: MappedFill | None = None
        self._unlocking: threading.Thread | None = None  # per-wake mode: the last wake's locks being undone

    @property
    def held_bytes(self) -> int:
        """Bytes of the checkpoint kept mapped (on a GPU: page-locked) between wakes."""
        return self._kept.mapped_bytes if self._kept is not None else 0

    def hold(self) -> None:
        """Held mode, at a level-2 sleep: map and start locking (a no-op while what is kept is
        current). Never fails the sleep: a file that cannot be read now is left to the wake, which
        says what is wrong."""
        if not self.held:
            return
        try:
            copies, versions = self._copies()
            if self._kept is not None and self._kept.matches(copies, versions):
                return
            self._drop()
            self._kept = MappedFill(copies, self._device, self._piece_bytes, versions=versions, warm=self._warm())
            self._kept.open()
        except Exception as exc:  # noqa: BLE001 - holding only saves time: the sleep stands
            self._drop()
            log.warning("checkpoint not held while asleep", error=f"{type(exc).__name__}: {exc}")

    def fill(self, flat: torch.Tensor) -> None:
        """Copy every wanted tensor into `flat` at its offset; returns once all have landed."""
        self.settle()
        try:
            copies, versions = self._copies()
        except BaseException:
            self._drop()  # what is kept no longer shows the file at its path
            raise
        if not self.held:
            fill = self._last = MappedFill(copies, self._device, self._piece_bytes, versions=versions)
            try:
                fill.run(flat, self._reloader)
            finally:
                if fill.locked_bytes:  # undoing the locks takes a while: not on the wake's path
                    self._unlocking = threading.Thread(target=fill.close, name="sleep-unlock", daemon=True)
                    self._unlocking.start()
                else:
                    fill.close()
            return
        if self._kept is None or not self._kept.matches(copies, versions):
            if self._kept is not None:
                log.info("checkpoint changed on disk since it was mapped: mapping it again")
            self._drop()  # a stale mapping is never read
            self._kept = MappedFill(copies, self._device, self._piece_bytes, versions=versions)
        self._last = self._kept
        try:
            self._kept.run(flat, self._reloader)
        except BaseException:
            self._drop()  # the next wake maps it afresh
            raise

    def stats(self) -> dict[str, float]:
        """How the last wake read the checkpoint: locked_bytes, staged_bytes, lock_s and warm_s
        (summed over the threads, since the mapping was made), wait_s (this wake's wait for pieces
        still being locked), lock_calls, runs (wakes this mapping served), held (1 while it is
        kept for the next wake), unlock_s (complete once settle() has returned)."""
        f = self._last
        if f is None:
            return {}
        return {
            "locked_bytes": f.locked_bytes,
            "staged_bytes": f.staged_bytes,
            "lock_s": f.lock_s,
            "warm_s": f.warm_s,
            "wait_s": f.wait_s,
            "lock_calls": f.lock_calls,
            "runs": f.runs,
            "held": int(f is self._kept),
            "unlock_s": f.unlock_s,
        }

    def settle(self) -> None:
        """Wait until the last per-wake fill has undone its locks and unmapped the files."""
        if self._unlocking is not None:
            self._unlocking.join()
            self._unlocking = None

    def close(self) -> None:
        """Undo every lock and unmap (the worker's end); idempotent."""
        self.settle()
        self._drop()

    def _drop(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.close()

    def _copies(self) -> tuple[list[Copy], dict[Path, FileVersion]]:
        """What a wake copies, and the version of each file its index was read from."""
        copies: list[Copy] = []
        found: set[tuple[Path, str]] = set()
        versions: dict[Path, FileVersion] = {}
        for weight_file in self.files:
            path = Path(weight_file.path)
            version = file_version(os.stat(path))
            index = read_index(path)
            if file_version(os.stat(path)) != version:
                raise CheckpointChanged(f"{path} was replaced while its index was read; wake again")
            versions[path] = version
            for key, record in index.items():
                w = self._wanted.get((path, key))
                if w is None:
                    continue
                if record.shape != w.shape or record.dtype != w.dtype:
                    raise ValueError(
                        f"{path}: {key} is {record.shape} {record.dtype}, the model holds {w.shape} {w.dtype}"
                    )
                copies.append(Copy(path, record.file_offset, w.offset, w.nbytes))
                found.add((path, key))
        missing = sorted(self._wanted.keys() - found)
        if missing:
            named = [f"{key} (in {path})" for path, key in missing[:3]]
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) to reload, e.g. {named}")
        return copies, versions

"""Reload weights from safetensors checkpoints into one device buffer at copy-engine speed.

`MappedFill` (the level-2 wake): each file is mapped read-only and shared (its pages are the page
cache), the pieces the weights lie in are page-locked in place on background threads, in order,
and every tensor is copied by DMA straight from the locked pages as soon as its piece is ready:
no staging copy, so host memory traffic is one read per byte. The caller either closes it after
one wake (the locks undone and the files unmapped off the wake's path) or keeps it for the next
wakes, which are then pure DMA; each file's version is recorded when it is opened, so a kept
fill can tell that a file was replaced on disk since.

`Reloader` (the fallback for pieces the driver refuses to lock): file ranges are read (pread,
in parallel threads that release the GIL) into two page-locked staging chunks, and each filled
chunk is copied to the device asynchronously while the other is being read. On the CPU the
same paths run with plain host memory and no streams.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from stagemesh.stage_service import platform
from stagemesh.stage_service.worker.host_pages import PIECE_BYTES, LockedPieces, Ranges, Warm, touched_spans
from stagemesh.weight_store.checkpoint import CheckpointError, FileVersion, file_version, map_descriptor

CHUNK_BYTES = 256 << 20
READ_PIECE_BYTES = 16 << 20  # one pread per piece: enough of them to keep every thread busy
READ_THREADS = min(16, os.cpu_count() or 1)


@dataclass(frozen=True)
class Copy:
    """`nbytes` bytes from `path` at `file_offset` go to the device buffer at `device_offset`."""

    path: Path
    file_offset: int
    device_offset: int
    nbytes: int


def _split(copies: list[Copy], limit: int) -> list[Copy]:
    out = []
    for c in copies:
        for start in range(0, c.nbytes, limit):
            n = min(limit, c.nbytes - start)
            out.append(Copy(c.path, c.file_offset + start, c.device_offset + start, n))
    return out


def _chunks(copies: list[Copy]) -> list[list[Copy]]:
    groups: list[list[Copy]] = []
    current: list[Copy] = []
    used = 0
    for c in _split(copies, CHUNK_BYTES):
        if used + c.nbytes > CHUNK_BYTES and current:
            groups.append(current)
            current, used = [], 0
        current.append(c)
        used += c.nbytes
    if current:
        groups.append(current)
    return groups


class Reloader:
    """Owns the two staging chunks (allocated on first use, freed by `release()`)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._pin = platform.is_cuda(self.device)
        self._buffers: list[platform.HostBuffer] = []
        self._staging: list[torch.Tensor] = []

    def prepare(self) -> None:
        """Allocate the staging chunks (page-locked for a CUDA device; exact size, their own pages)."""
        if not self._staging:
            self._buffers = [platform.HostBuffer(CHUNK_BYTES, self.device) for _ in range(2)]
            self._staging = [b.tensor for b in self._buffers]

    def release(self) -> None:
        """Give the chunks back to the system (not to a cache that would keep them)."""
        self._staging = []
        for b in self._buffers:
            b.close()
        self._buffers = []

    def fill(self, flat: torch.Tensor, copies: list[Copy], opened: dict[Path, int] | None = None) -> None:
        """`opened`: descriptors to read files from (they stay open); others are opened here."""
        self.prepare()
        stream = platform.Stream(self.device)
        done = [platform.DeviceEvent(self.device).record(stream) for _ in self._staging]
        opened = opened or {}
        own = {p: os.open(p, os.O_RDONLY) for p in {c.path for c in copies} - opened.keys()}
        files = {**opened, **own}
        try:
            with ThreadPoolExecutor(READ_THREADS) as pool:
                for index, group in enumerate(_chunks(copies)):
                    slot = index % len(self._staging)
                    done[slot].synchronize()  # its previous device copy has finished
                    staging = self._staging[slot]
                    placed = self._read(pool, files, staging, group)
                    with stream.active():
                        for c, start in placed:
                            flat[c.device_offset : c.device_offset + c.nbytes].copy_(
                                staging[start : start + c.nbytes], non_blocking=self._pin
                            )
                    done[slot] = platform.DeviceEvent(self.device).record(stream)
            stream.synchronize()
        finally:
            for fd in own.values():
                os.close(fd)

    @staticmethod
    def _read(
        pool: ThreadPoolExecutor, files: dict[Path, int], staging: torch.Tensor, group: list[Copy]
    ) -> list[tuple[Copy, int]]:
        view = memoryview(staging.numpy())  # type: ignore[arg-type]  # numpy stubs omit the buffer protocol
        placed, jobs, start = [], [], 0
        for c in group:
            placed.append((c, start))
            for piece in range(0, c.nbytes, READ_PIECE_BYTES):
                n = min(READ_PIECE_BYTES, c.nbytes - piece)
                jobs.append(
                    pool.submit(
                        _pread_exact, files[c.path], view[start + piece : start + piece + n], c.file_offset + piece
                    )
                )
            start += c.nbytes
        for job in jobs:
            job.result()
        return placed


def _pread_exact(fd: int, target: memoryview, offset: int) -> None:
    while len(target):
        n = os.preadv(fd, [target], offset)
        if n <= 0:
            raise OSError(f"checkpoint ended early at offset {offset}")
        target, offset = target[n:], offset + n


def _prefetch(fd: int):
    def start_reading(start: int, end: int) -> None:
        # Asynchronous readahead: a cold piece is on its way from disk before its lock faults it in.
        with contextlib.suppress(OSError):  # a hint; a sandbox may not take it
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)

    return start_reading


@dataclass
class _Mapped:
    """One checkpoint file of a MappedFill: open, mapped, its pieces being locked."""

    path: Path
    fd: int
    mapping: torch.Tensor
    pieces: LockedPieces
    copies: list[Copy]
    ranges: Ranges


class CheckpointChanged(CheckpointError):
    """A checkpoint file was replaced or rewritten while a wake was reading it."""


class MappedFill:
    """Level-2 wakes' reads: `copies` straight from the page-locked checkpoint mappings.

    `open()` maps every file and starts locking its pieces on background threads; `run()` fills
    a device buffer, copying from each piece as soon as it is ready, and may be called for wake
    after wake while the mappings and locks are kept; `close()` undoes the locks and unmaps.
    `versions`: the version (`file_version`) each file must still have when it is opened, as
    when its index was read (else `CheckpointChanged`); `matches()` tells whether this fill still
    shows what is on disk. `must_lock`: see LockedPieces (default: a CUDA target); `warm`: see
    LockedPieces (for a mapping locked ahead of its first wake)."""

    def __init__(
        self,
        copies: list[Copy],
        device: str | torch.device,
        piece_bytes: int = PIECE_BYTES,
        must_lock: bool | None = None,
        versions: dict[Path, FileVersion] | None = None,
        warm: Warm | None = None,
    ):
        self.device = torch.device(device)
        self.copies = list(copies)
        self.versions = dict(versions or {})
        self._piece_bytes = piece_bytes
        self._must_lock = must_lock
        self._warm = warm
        self._opened = False
        self._files: list[_Mapped] = []
        # Kept past close(): bytes of the pieces locked, seconds the locking (and warming) threads
        # took, summed; seconds close() took. Of the last run(): bytes staged instead of copied
        # from a locked piece, seconds it waited for pieces still being locked. Runs so far.
        self.locked_bytes = 0
        self.mapped_bytes = 0
        self.lock_s = 0.0
        self.warm_s = 0.0
        self.unlock_s = 0.0
        self.staged_bytes = 0
        self.wait_s = 0.0
        self.runs = 0

    def matches(self, copies: list[Copy], versions: dict[Path, FileVersion]) -> bool:
        """Whether this fill reads exactly `copies` from files at exactly `versions`."""
        return self.copies == copies and self.versions == versions

    def open(self) -> MappedFill:
        """Map every file and start locking its pieces (once); returns at once."""
        if self._opened:
            return self
        by_file: dict[Path, list[Copy]] = {}
        for c in self.copies:
            by_file.setdefault(c.path, []).append(c)
        try:
            for path, copies in by_file.items():
                self._open(path, copies)
        except BaseException:
            self.close()  # what was opened already
            raise
        self._opened = True
        self._warm = None  # each file's pieces hold it while they need it
        self.mapped_bytes = sum(f.pieces.nbytes for f in self._files)
        return self

    def _open(self, path: Path, copies: list[Copy]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            version = file_version(os.fstat(fd))
            if self.versions.setdefault(path, version) != version:
                raise CheckpointChanged(f"{path} was replaced while it was being read; wake again")
            mapping = map_descriptor(fd)
            ranges = [(c.file_offset, c.nbytes) for c in copies]
            pieces = LockedPieces(
                mapping,
                touched_spans(ranges, mapping.numel(), self._piece_bytes),
                self.device,
                read_only=True,
                prefetch=_prefetch(fd),
                must_lock=self._must_lock,
                warm=self._warm,
            )
        except BaseException:
            os.close(fd)
            raise
        self._files.append(_Mapped(path, fd, mapping, pieces.start(), copies, Ranges(ranges)))

    def run(self, flat: torch.Tensor, staged: Reloader) -> None:
        """Fill `flat`; returns once every copy has landed. Pieces that could not be locked go
        through `staged` (whose chunks are released again afterwards)."""
        self.open()
        stream = platform.Stream(self.device)
        fallback: list[Copy] = []
        self.wait_s = 0.0
        try:
            with stream.active():
                for f in self._files:
                    pieces = iter(f.pieces)
                    while True:
                        waited = time.perf_counter()
                        piece = next(pieces, None)
                        self.wait_s += time.perf_counter() - waited
                        if piece is None:
                            break
                        for i, lo, hi in f.ranges.within(piece):
                            c = f.copies[i]
                            at = c.device_offset + lo - c.file_offset
                            if piece.direct:
                                flat[at : at + hi - lo].copy_(f.mapping[lo:hi], non_blocking=piece.locked)
                            else:
                                fallback.append(Copy(c.path, lo, at, hi - lo))
        finally:
            stream.synchronize()  # also on failure: no copy may still read a page close() unlocks
        self.locked_bytes = sum(f.pieces.locked_bytes for f in self._files)
        self.lock_s = sum(f.pieces.lock_s for f in self._files)
        self.warm_s = sum(f.pieces.warm_s for f in self._files)
        self.staged_bytes = sum(c.nbytes for c in fallback)
        if fallback:
            try:  # from the very files mapped, whatever is at their paths now
                staged.fill(flat, fallback, {f.path: f.fd for f in self._files})
            finally:
                staged.release()
        self.runs += 1

    @property
    def lock_calls(self) -> int:
        """Ranges locked so far (each once, however many runs read them)."""
        return sum(f.pieces.locks for f in self._files)

    def close(self) -> None:
        """Undo the locks, then drop the mappings (idempotent)."""
        started = time.perf_counter()
        files, self._files = self._files, []
        self._opened = False
        for f in files:
            f.pieces.unlock()
            os.close(f.fd)
        files.clear()  # the last references to the mappings: they are unmapped here
        self.unlock_s += time.perf_counter() - started

"""Reading the checkpoint into the page cache while the worker still imports.

A worker's first seconds go to importing torch (and, for a diffusers folder, diffusers and
transformers) before its loader reads a byte. Started first thing in the worker, before those
imports, a few threads read the files the stage's kind loads, in file order, into one reused
buffer each: the bytes land in the page cache, and the loader's direct read (models.direct_load)
then finds them there. With the cache hot this costs a copy per byte on other cores; with it
dropped it takes the disk read off the critical path, up to the length of the imports.

Light on purpose (no torch): it runs before the imports it overlaps. The files come from the
folder's JSON alone; what is past half of the available memory is left for the loader, so a
read-ahead never evicts its own first files. A file that cannot be read stops the read-ahead
and fails the load before it starts, naming the file (`raise_if_failed`); `stop` ends and joins
the threads, whatever happened, and records the "read-ahead" start-up phase.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from stagemesh.core import logs, startup
from stagemesh.stage_service.models import diffusers_adapter
from stagemesh.stage_service.settings import StageSettings

log = logs.get_logger("stagemesh.worker")

PHASE = "read-ahead"
THREADS = 4
PIECE_BYTES = 16 << 20
# Of MemAvailable: more read ahead would push the first files out before the loader reads them.
MEMORY_SHARE = 0.5
# The embedded model's files, by stage kind (stage_service/models/weights.py's layout).
EMBEDDED_FOLDERS = {"ar": ("lm",), "diffusion": ("dit",)}


class ReadAheadFailed(OSError):
    """A checkpoint file could not be read; the message names it."""


def checkpoint_files(kind: str, model_dir: Path) -> list[Path]:
    """The weight files a `kind` stage loads from `model_dir` (reads JSON only)."""
    if diffusers_adapter.is_diffusers_folder(model_dir):
        folder = diffusers_adapter.open_folder(model_dir)
        names = [n for n in folder.needed_by(kind) if n != "scheduler" and not n.startswith("tokenizer")]
        return [file for name in names for file in folder.weight_files(name)]
    return [
        file
        for sub in EMBEDDED_FOLDERS.get(kind, ())
        for file in sorted((Path(model_dir) / sub).glob("*.safetensors"))
        if file.is_file()
    ]


def available_memory() -> int | None:
    """MemAvailable in bytes, from /proc/meminfo; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pieces(sizes: Iterable[tuple[Path, int]], budget: int | None, piece_bytes: int) -> Iterator[tuple[Path, int, int]]:
    """(file, offset, length) in file order, up to `budget` bytes in all (None: no limit)."""
    left = budget
    for path, size in sizes:
        if left is not None:
            size = min(size, left)
            left -= size
        for offset in range(0, size, piece_bytes):
            yield path, offset, min(piece_bytes, size - offset)


class ReadAhead:
    """Background threads reading `files` once; start() begins, stop() ends and joins them."""

    def __init__(
        self,
        files: list[Path],
        *,
        threads: int = THREADS,
        piece_bytes: int = PIECE_BYTES,
        budget_bytes: int | None = None,
    ) -> None:
        self.files = list(files)
        # The sizes now: a file that shrinks before it is read is an error, not a shorter plan.
        sizes = [(f, f.stat().st_size) for f in self.files]
        self.total = sum(size for _, size in sizes)
        self.budget = budget_bytes
        self.planned = self.total if budget_bytes is None else min(self.total, budget_bytes)
        self.bytes_read = 0
        self.error: ReadAheadFailed | None = None
        self._pieces = _pieces(sizes, budget_bytes, piece_bytes)
        self._piece_bytes = piece_bytes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, name=f"read-ahead-{i}", daemon=True) for i in range(max(1, threads))
        ]
        self._at = 0.0
        self._started = 0.0
        self._finished = 0.0
        self._done = 0  # threads that ran out of pieces
        self._all_done = threading.Event()
        self._stopped = False

    def start(self) -> ReadAhead:
        self._at, self._started = time.time(), time.perf_counter()
        for t in self._threads:
            t.start()
        return self

    @property
    def complete(self) -> bool:
        return self.error is None and self.bytes_read == self.planned

    def _next(self) -> tuple[Path, int, int] | None:
        with self._lock:
            if self._stop.is_set():
                return None
            return next(self._pieces, None)

    def _work(self) -> None:
        buffer = bytearray(self._piece_bytes)
        view = memoryview(buffer)
        fds: dict[Path, int] = {}
        try:
            while (piece := self._next()) is not None:
                path, offset, length = piece
                try:
                    if path not in fds:
                        fds[path] = os.open(path, os.O_RDONLY)
                    n = os.preadv(fds[path], [view[:length]], offset)
                except OSError as exc:
                    self._fail(ReadAheadFailed(exc.errno, f"{path}: cannot be read ({exc.strerror or exc})"))
                    return
                with self._lock:
                    self.bytes_read += n
                if n < length:  # the file shrank since it was listed: the loader will say so
                    self._fail(ReadAheadFailed(0, f"{path}: file ended at byte {offset + n} while reading it"))
                    return
        finally:
            for fd in fds.values():
                os.close(fd)
            with self._lock:
                self._done += 1
                if self._done == len(self._threads):
                    self._finished = time.perf_counter()
                    self._all_done.set()

    def _fail(self, error: ReadAheadFailed) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
        self._stop.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether every thread has run out of pieces (or stopped) within `timeout_s`."""
        return self._all_done.wait(timeout_s)

    def raise_if_failed(self) -> None:
        """Before the load: a file the read-ahead could not read fails the start, naming it."""
        if self.error is not None:
            raise self.error

    def stop(self) -> dict | None:
        """Stop after each thread's current piece, join them, record the phase (once)."""
        self._stop.set()
        for t in self._threads:
            if t.is_alive() or t.ident is not None:
                t.join()
        if self._stopped or not self._at:
            return None
        self._stopped = True
        ended = self._finished or time.perf_counter()
        return startup.record(
            PHASE,
            self._at,
            ended - self._started,
            files=len(self.files),
            bytes=self.bytes_read,
            planned=self.planned,
            complete=self.complete,
            **({"error": str(self.error)} if self.error is not None else {}),
        )


def start_for(settings: StageSettings, model_dir: Path) -> ReadAhead | None:
    """The read-ahead of a stage's checkpoint, started; None when `read_ahead` is off, or there
    is nothing to read (a folder this cannot list is left for the load to judge)."""
    if not settings.read_ahead:
        return None
    available = available_memory()
    budget = int(available * MEMORY_SHARE) if available is not None else None
    try:
        files = checkpoint_files(settings.kind, model_dir)
        ahead = ReadAhead(files, budget_bytes=budget) if files else None
    except (OSError, ValueError) as exc:  # FolderError is a ValueError: the load names the file
        log.info("no read-ahead: the folder's files could not be listed", reason=str(exc))
        return None
    if ahead is None:
        return None
    if ahead.planned < ahead.total:
        log.info("read-ahead limited by the available memory", planned=ahead.planned, total=ahead.total)
    return ahead.start()

"""Safetensors files read straight into device tensors, several reads in flight.

The ordinary path (from_pretrained on the host, then `.to(device)`) reads every byte through the
page cache into host tensors and copies them again, pageable, one tensor after another. Here the
destination tensors are made on the device first and the files are read in pieces of up to
`PIECE_BYTES` by `threads` threads: on a CUDA device each thread reads into its own page-locked
bounce buffers (two, so one piece's copy overlaps the next piece's read) and copies them with
non-blocking copies on its own stream; on the CPU each piece is read straight into the
destination tensor's bytes, with no bounce at all. Pieces come from every file of every
component at once, so the transformer's shards and the VAE load together.

`read_tensors` gives the same tensors as safetensors' `load_file` (names, dtypes, shapes,
bytes), which the tests check. A failed read (a short file, an I/O error) raises after every
thread has stopped; the tensors made so far are dropped with the call's frame.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from stagemesh.stage_service import platform
from stagemesh.weight_store.checkpoint import CheckpointError, TensorRecord, read_index

# 8 threads x 2 bounce buffers x 32 MiB: 512 MiB page-locked while a load runs.
PIECE_BYTES = 32 << 20
THREADS = 8


@dataclass(frozen=True)
class _Piece:
    """Bytes [start, start + nbytes) of one tensor's data, read from `path` at `file_offset`."""

    name: str
    path: Path
    file_offset: int
    start: int
    nbytes: int


def records_of(files: Iterable[Path]) -> dict[str, TensorRecord]:
    """Every tensor of `files` by name; a name stored twice is refused (a sharded checkpoint
    stores each tensor once)."""
    out: dict[str, TensorRecord] = {}
    for path in files:
        for name, record in read_index(path).items():
            if name in out:
                raise CheckpointError(f"{path}: tensor {name!r} is also stored in {out[name].path}")
            out[name] = record
    return out


def _pieces(records: dict[str, TensorRecord], piece_bytes: int) -> Iterator[_Piece]:
    for name, r in records.items():
        for start in range(0, r.nbytes, piece_bytes):
            yield _Piece(name, r.path, r.file_offset + start, start, min(piece_bytes, r.nbytes - start))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A flat uint8 CPU tensor's memory, writable in place."""
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray exports the buffer


def _read_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{path}: file ended at byte {offset + done} while reading its tensors")
        done += n


class _Reader:
    """One thread's state: open files, and on CUDA its stream and two bounce buffers."""

    def __init__(self, device: torch.device, piece_bytes: int) -> None:
        self.device = device
        self.fds: dict[Path, int] = {}
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.bounce = [torch.empty(piece_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.copied: list[torch.cuda.Event | None] = [None, None]
            self.turn = 0

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def read(self, piece: _Piece, target: torch.Tensor) -> None:
        """`target`: the destination tensor's bytes, flat uint8."""
        dest = target[piece.start : piece.start + piece.nbytes]
        if not self.cuda:
            _read_exact(self.fd(piece.path), _bytes_of(dest), piece.file_offset, piece.path)
            return
        k, self.turn = self.turn, 1 - self.turn
        last = self.copied[k]
        if last is not None:
            last.synchronize()  # its last copy has left the buffer
        bounce = self.bounce[k][: piece.nbytes]
        _read_exact(self.fd(piece.path), _bytes_of(bounce), piece.file_offset, piece.path)
        with torch.cuda.stream(self.stream):
            dest.copy_(bounce, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copied[k] = event

    def close(self) -> None:
        if self.cuda:
            self.stream.synchronize()  # the last copies are done before the buffers go
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def read_tensors(
    files: Iterable[Path],
    device: str | torch.device = "cpu",
    *,
    threads: int = THREADS,
    piece_bytes: int = PIECE_BYTES,
    records: dict[str, TensorRecord] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of `files` on `device`, read in parallel; or, given `records` (name ->
    record, e.g. from `records_of`, names free), those under their names. Raises
    CheckpointError (a malformed or short file) or OSError after every read has stopped."""
    device = torch.device(device)
    wanted = records if records is not None else records_of(files)
    tensors = {name: torch.empty(r.shape, dtype=r.dtype, device=device) for name, r in wanted.items()}
    flat = {name: t.reshape(-1).view(torch.uint8) for name, t in tensors.items()}
    # In file order: each thread's reads stay near one another on the disk.
    pieces = sorted(_pieces(wanted, piece_bytes), key=lambda p: (str(p.path), p.file_offset))
    local = threading.local()
    readers: list[_Reader] = []
    lock = threading.Lock()
    failed = threading.Event()

    def work(piece: _Piece) -> None:
        if failed.is_set():
            return  # another piece failed: the call raises its error
        reader = getattr(local, "reader", None)
        if reader is None:
            reader = local.reader = _Reader(device, piece_bytes)
            with lock:
                readers.append(reader)
        try:
            reader.read(piece, flat[piece.name])
        except BaseException:
            failed.set()
            raise

    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="direct-load") as pool:
            # list(): the first failure raises here, after the pool has run out its pieces.
            list(pool.map(work, pieces))
    finally:
        for reader in readers:
            reader.close()
    if device.type == "cuda":
        platform.current_stream(device).synchronize()
        release_host_cache()  # the bounce buffers' page-locked memory goes back to the system
    return tensors


def release_host_cache() -> None:
    """torch keeps freed page-locked buffers cached for reuse; a load's are not reused."""
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):  # named so in newer / older torch
        empty = getattr(torch._C, name, None)
        if empty is not None:
            empty()
            return

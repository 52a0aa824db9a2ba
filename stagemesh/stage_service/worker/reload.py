"""Reload weights from a safetensors checkpoint into one device buffer at copy-engine speed.

Copying from a memory map faults every 4 KiB page and goes through pageable-memory transfers.
Instead, file ranges are read (pread, in parallel threads that release the GIL) into two pinned
staging chunks, and each filled chunk is copied to the device asynchronously while the other
chunk is being read. On the CPU the same path runs with plain host memory and no streams.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from stagemesh.stage_service import platform

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
    """Owns the two staging chunks (allocated once, reused by every wake)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._pin = platform.is_cuda(self.device)
        self._staging: list[torch.Tensor] = []

    def prepare(self) -> None:
        """Allocate the pinned staging chunks ahead of time (pinning is slow; do it at sleep)."""
        if not self._staging:
            self._staging = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=self._pin) for _ in range(2)]

    def release(self) -> None:
        self._staging = []

    def fill(self, flat: torch.Tensor, copies: list[Copy]) -> None:
        self.prepare()
        stream = platform.Stream(self.device)
        done = [platform.DeviceEvent(self.device).record(stream) for _ in self._staging]
        files = {p: os.open(p, os.O_RDONLY) for p in {c.path for c in copies}}
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
            for fd in files.values():
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

"""Reusable shared-memory slots between one worker (writer) and its executor (reader).

Creating a fresh /dev/shm segment per output costs a page allocation for every 4 KiB, which on
large outputs is slower than the copy itself. A worker therefore keeps a few slots it reuses:
each slot is a segment whose first byte says whether the reader still holds its data. The
reader maps a slot once, hands out a zero-copy tensor over it, and clears the byte when the
last view of that tensor is freed. A slot's name is unlinked by whoever sweeps its worker (the
executor, on the worker's death or at shutdown), never left behind.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 64  # byte 0: 1 while the reader holds the data, 0 when the slot is free
_FREE, _FULL = 0, 1
_ALIGN = 1 << 20


def map_fd(fd: int, size: int, shared: bool = True) -> mmap.mmap:
    # MAP_POPULATE faults every page in one call instead of one fault per 4 KiB page.
    flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def copy_into(mapping: mmap.mmap, offset: int, raw: torch.Tensor) -> None:
    """Copy `raw` (uint8, contiguous, on the host) into `mapping` at `offset`: one plain memcpy
    on this thread, with the GIL released (ctypes drops it for the call), so the thread that
    launches the forward pass keeps running while an output is copied."""
    if not raw.numel():
        return
    dst = np.frombuffer(mapping, dtype=np.uint8, count=raw.numel(), offset=offset)
    try:
        ctypes.memmove(dst.ctypes.data, raw.data_ptr(), raw.numel())
    finally:
        del dst  # the mapping cannot close while a view exports it


@dataclass
class _Slot:
    name: str
    capacity: int
    mapping: mmap.mmap

    def is_free(self) -> bool:
        return self.mapping[0] == _FREE


class SlotPool:
    """Writer side: up to `max_slots` reusable segments totalling at most `max_bytes`."""

    def __init__(self, name_prefix: str, max_slots: int = 4, max_bytes: int = 2 << 30):
        self._prefix = name_prefix
        self._max_slots = max_slots
        self._max_bytes = max_bytes
        self._slots: list[_Slot] = []

    def write(self, raw: torch.Tensor) -> str | None:
        """Copy `raw` (uint8, contiguous) into a free slot; None when no slot can take it."""
        slot = self._acquire(raw.numel())
        if slot is None:
            return None
        copy_into(slot.mapping, HEADER_BYTES, raw)
        slot.mapping[0] = _FULL  # after the data: the reader looks only once the message arrives
        return slot.name

    def free(self, name: str) -> None:
        """Give a slot back whose payload will never be read (a pack that failed half way)."""
        for slot in self._slots:
            if slot.name == name:
                slot.mapping[0] = _FREE

    def _acquire(self, nbytes: int) -> _Slot | None:
        free = [s for s in self._slots if s.is_free() and s.capacity >= nbytes]
        if free:
            return min(free, key=lambda s: s.capacity)
        capacity = -(-nbytes // _ALIGN) * _ALIGN
        if len(self._slots) >= self._max_slots or self.total_bytes() + capacity > self._max_bytes:
            return None
        slot = self._create(capacity)
        self._slots.append(slot)
        return slot

    def _create(self, capacity: int) -> _Slot:
        name = f"{self._prefix}-{secrets.token_hex(16)}"  # unguessable: no other user can pre-create it
        path = SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + capacity)
            return _Slot(name, capacity, map_fd(fd, HEADER_BYTES + capacity))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def total_bytes(self) -> int:
        return sum(s.capacity for s in self._slots)

    def close(self, unlink: bool = True) -> None:
        for slot in self._slots:
            if unlink:
                (SHM_DIR / slot.name).unlink(missing_ok=True)
        self._slots.clear()


class SlotReader:
    """Reader side: one mapping per slot, zero-copy tensors that free their slot when dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mappings: dict[str, mmap.mmap] = {}

    def read(self, name: str, nbytes: int) -> torch.Tensor:
        mapping = self._mapping(name, nbytes)
        array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=HEADER_BYTES)
        # torch keeps `array` alive exactly as long as any view of the storage lives.
        weakref.finalize(array, _release, mapping)
        return torch.from_numpy(array)

    def _mapping(self, name: str, nbytes: int) -> mmap.mmap:
        with self._lock:
            mapping = self._mappings.get(name)
            if mapping is None or len(mapping) < HEADER_BYTES + nbytes:
                fd = os.open(SHM_DIR / name, os.O_RDWR)
                try:
                    mapping = map_fd(fd, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
                self._mappings[name] = mapping
            return mapping

    def forget(self, prefix: str) -> None:
        """Drop the mappings of a gone writer; live tensors keep theirs until freed."""
        with self._lock:
            for name in [n for n in self._mappings if n.startswith(prefix)]:
                del self._mappings[name]


def _release(mapping: mmap.mmap) -> None:
    try:
        mapping[0] = _FREE
    except ValueError:
        pass  # mapping already closed: the writer is gone too

"""Tensor packing for the worker -> executor queues.

Tensors travel as raw bytes plus dtype and shape, never as torch objects (pickling a tensor
through a multiprocessing queue would route it through torch's own shared-memory reducers,
whose segments we could not account for). A tensor whose view or storage is larger than
SHM_THRESHOLD_BYTES goes through a POSIX shared-memory segment that the reader unlinks; smaller
ones travel inline. Only the view's own bytes are shipped, so a slice of a batch ships its slice.
Containers are walked recursively into new containers; the input is never mutated.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import torch

SHM_THRESHOLD_BYTES = 1_000_000
SHM_PREFIX = "stagemesh"
_SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class PackedTensor:
    dtype: str
    shape: tuple[int, ...]
    data: bytes | None = None  # inline bytes, or
    shm_name: str | None = None  # a segment holding `nbytes` bytes
    nbytes: int = 0


def segment_name(owner_pid: int, rank: int) -> str:
    """Unguessable, and tells a sweeper which executor (pid) and worker (rank) it belongs to."""
    return f"{SHM_PREFIX}-{owner_pid}-{rank}-{uuid.uuid4().hex}"


def _storage_nbytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0


def goes_to_shm(tensor: torch.Tensor) -> bool:
    view_bytes = tensor.numel() * tensor.element_size()
    return max(view_bytes, _storage_nbytes(tensor)) > SHM_THRESHOLD_BYTES


def _as_bytes_tensor(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
    # The reader unlinks it; our resource tracker must not unlink it (again) when we exit.
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    return shm


class Packer:
    """Packs outputs for one writer (a worker rank); names its segments for sweeping."""

    def __init__(self, owner_pid: int, rank: int):
        self.owner_pid, self.rank = owner_pid, rank

    def pack(self, obj):
        if isinstance(obj, torch.Tensor):
            return self._pack_tensor(obj)
        if isinstance(obj, dict):
            return {k: self.pack(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.pack(v) for v in obj)
        return obj

    def _pack_tensor(self, tensor: torch.Tensor) -> PackedTensor:
        dtype, shape = str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)
        raw = _as_bytes_tensor(tensor)
        if not goes_to_shm(tensor):
            return PackedTensor(dtype, shape, data=raw.numpy().tobytes())
        name = segment_name(self.owner_pid, self.rank)
        shm = _create_segment(name, raw.numel())
        try:
            torch.frombuffer(shm.buf, dtype=torch.uint8, count=raw.numel()).copy_(raw)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        shm.close()
        return PackedTensor(dtype, shape, shm_name=name, nbytes=raw.numel())


def pack(obj, owner_pid: int | None = None, rank: int = 0):
    return Packer(owner_pid if owner_pid is not None else os.getpid(), rank).pack(obj)


def _unpack_tensor(packed: PackedTensor) -> torch.Tensor:
    dtype = getattr(torch, packed.dtype)
    if packed.shm_name is None:
        if not packed.data:
            return torch.empty(packed.shape, dtype=dtype)
        raw = torch.frombuffer(bytearray(packed.data), dtype=torch.uint8)
    else:
        shm = shared_memory.SharedMemory(name=packed.shm_name)
        try:
            raw = torch.empty(packed.nbytes, dtype=torch.uint8)
            if packed.nbytes:
                raw.copy_(torch.frombuffer(shm.buf, dtype=torch.uint8, count=packed.nbytes))
        finally:
            shm.close()
            shm.unlink()  # also drops this process's resource-tracker registration
    return raw.view(dtype).reshape(packed.shape)


def unpack(obj):
    """Rebuild what `pack` made; every segment met is copied out and unlinked."""
    if isinstance(obj, PackedTensor):
        return _unpack_tensor(obj)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(v) for v in obj)
    return obj


def discard(obj) -> None:
    """Unlink the segments of a packed payload nobody will read (e.g. a cancelled request's)."""
    if isinstance(obj, PackedTensor) and obj.shm_name:
        unlink_segment(obj.shm_name)
    elif isinstance(obj, dict):
        for v in obj.values():
            discard(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            discard(v)


def unlink_segment(name: str) -> None:
    try:
        (_SHM_DIR / name).unlink()
    except FileNotFoundError:
        pass


def sweep(owner_pid: int, rank: int | None = None) -> int:
    """Unlink the segments of one executor (and one worker rank); returns how many."""
    prefix = f"{SHM_PREFIX}-{owner_pid}-" + ("" if rank is None else f"{rank}-")
    return _sweep(lambda name: name.startswith(prefix))


def sweep_orphans() -> int:
    """Unlink segments whose owning executor process no longer exists."""
    def orphan(name: str) -> bool:
        parts = name.split("-")
        if len(parts) != 4 or parts[0] != SHM_PREFIX or not parts[1].isdigit():
            return False
        return not Path(f"/proc/{parts[1]}").exists()
    return _sweep(orphan)


def _sweep(match) -> int:
    if not _SHM_DIR.is_dir():
        return 0
    removed = 0
    for entry in _SHM_DIR.iterdir():
        if match(entry.name):
            unlink_segment(entry.name)
            removed += 1
    return removed

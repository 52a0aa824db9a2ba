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
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch

from stagemesh.core import logs
from stagemesh.stage_service.transport.shm_pool import SlotPool, SlotReader, copy_into, map_fd
from stagemesh.stage_service.transport.tensors import dtype_name, host_bytes

SHM_THRESHOLD_BYTES = 1_000_000
WORKER_POOL_SLOTS = 16  # reusable segments per worker (see shm_pool): queued batches of four and outputs still read
log = logs.get_logger("stagemesh.ipc")

SHM_PREFIX = "stagemesh"
_SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class PackedTensor:
    dtype: str
    shape: tuple[int, ...]
    data: bytearray | None = None  # inline bytes (mutable: the reader wraps them without a copy), or
    shm_name: str | None = None  # a segment holding `nbytes` bytes
    nbytes: int = 0
    pooled: bool = False  # the segment is a reusable slot of the writer's pool (see shm_pool)


def segment_name(owner_pid: int, rank: int) -> str:
    """Unguessable, and tells a sweeper which executor (pid) and worker (rank) it belongs to."""
    return f"{SHM_PREFIX}-{owner_pid}-{rank}-{secrets.token_hex(16)}"  # 128 random bits


def _storage_nbytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0


def goes_to_shm(tensor: torch.Tensor) -> bool:
    view_bytes = tensor.numel() * tensor.element_size()
    return max(view_bytes, _storage_nbytes(tensor)) > SHM_THRESHOLD_BYTES


def _write_segment(name: str, raw: torch.Tensor) -> None:
    """Create /dev/shm/<name> (mode 0600, must not exist) holding exactly `raw`'s bytes."""
    path = _SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        size = max(raw.numel(), 1)
        os.ftruncate(fd, size)
        with map_fd(fd, size) as mapping:
            copy_into(mapping, 0, raw)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _read_segment(name: str, nbytes: int) -> torch.Tensor:
    """Map a segment privately and unlink its name at once: the tensor keeps the pages, no copy."""
    path = _SHM_DIR / name
    fd = os.open(path, os.O_RDONLY if nbytes == 0 else os.O_RDWR)
    try:
        path.unlink()
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(map_fd(fd, nbytes, shared=False), dtype=torch.uint8, count=nbytes)
    finally:
        os.close(fd)


class Packer:
    """Packs outputs for one writer (a worker rank); names its segments for sweeping.

    With `pool_slots` > 0, large tensors go to reusable slots (see shm_pool) when one is free,
    else to a one-shot segment the reader unlinks.
    """

    def __init__(self, owner_pid: int, rank: int, pool_slots: int = 0):
        self.owner_pid, self.rank = owner_pid, rank
        self.pool = SlotPool(f"{SHM_PREFIX}-{owner_pid}-{rank}", pool_slots) if pool_slots else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def pack(self, obj):
        made: list[PackedTensor] = []
        try:
            return self._pack(obj, made)
        except BaseException:
            # A half-packed payload reaches no reader: free what it took.
            for packed in made:
                assert packed.shm_name is not None  # `made` notes segments only
                if packed.pooled and self.pool is not None:  # a pooled slot came from the pool
                    self.pool.free(packed.shm_name)
                else:
                    unlink_segment(packed.shm_name)
            raise

    def _pack(self, obj, made: list[PackedTensor]):
        if isinstance(obj, torch.Tensor):
            packed = self._pack_tensor(obj)
            if packed.shm_name is not None:
                made.append(packed)
            return packed
        if isinstance(obj, dict):
            return {k: self._pack(v, made) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return _rebuild(obj, [self._pack(v, made) for v in obj])
        return obj

    def _pack_tensor(self, tensor: torch.Tensor) -> PackedTensor:
        dtype, shape = dtype_name(tensor.dtype), tuple(tensor.shape)
        raw = host_bytes(tensor)
        if not goes_to_shm(tensor):
            return PackedTensor(dtype, shape, data=bytearray(raw.numpy()))
        if self.pool is not None and (slot := self.pool.write(raw)) is not None:
            return PackedTensor(dtype, shape, shm_name=slot, nbytes=raw.numel(), pooled=True)
        name = segment_name(self.owner_pid, self.rank)
        _write_segment(name, raw)
        return PackedTensor(dtype, shape, shm_name=name, nbytes=raw.numel())


def _rebuild(original: list | tuple, items: list):
    """A new container of the original's type (namedtuples take their fields positionally)."""
    if isinstance(original, tuple) and hasattr(original, "_fields"):
        return type(original)(*items)
    return type(original)(items)


def pack(obj, owner_pid: int | None = None, rank: int = 0):
    return Packer(owner_pid if owner_pid is not None else os.getpid(), rank).pack(obj)


def _unpack_tensor(packed: PackedTensor) -> torch.Tensor:
    dtype = getattr(torch, packed.dtype)
    if packed.shm_name is None:
        if not packed.data:
            return torch.empty(packed.shape, dtype=dtype)
        raw = torch.frombuffer(packed.data, dtype=torch.uint8)
    elif packed.pooled:
        raw = _SLOT_READER.read(packed.shm_name, packed.nbytes)
    else:
        raw = _read_segment(packed.shm_name, packed.nbytes)
    return raw.view(dtype).reshape(packed.shape)


_SLOT_READER = SlotReader()


def unpack(obj):
    """Rebuild what `pack` made; every segment met is unlinked (its pages live on in the tensor)."""
    if isinstance(obj, PackedTensor):
        return _unpack_tensor(obj)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, [unpack(v) for v in obj])
    return obj


def discard(obj) -> None:
    """Free the segments of a packed payload nobody will read (e.g. a cancelled request's)."""
    if isinstance(obj, PackedTensor) and obj.shm_name:
        if obj.pooled:
            _SLOT_READER.read(obj.shm_name, obj.nbytes)  # the unreferenced tensor frees the slot at once
        else:
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
    _SLOT_READER.forget(prefix)
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
    """Unlink our own matching segments. /dev/shm is shared by every local user and sticky: a
    name another uid created under our pattern is not ours to remove (and cannot be), so it is
    skipped; a cleanup never raises, since its callers are a result pump and an exiting worker."""
    if not _SHM_DIR.is_dir():
        return 0
    removed = 0
    uid = os.geteuid()
    for entry in _SHM_DIR.iterdir():
        if not match(entry.name):
            continue
        try:
            if entry.lstat().st_uid != uid:
                continue
            unlink_segment(entry.name)
        except FileNotFoundError:
            continue  # its reader unlinked it meanwhile
        except OSError as exc:
            log.warning("could not remove a shared-memory segment", segment=entry.name, error=str(exc))
            continue
        removed += 1
    return removed

"""Writing, checking and discarding entries. Every function here expects the caller to hold the
key's publication lock (stagemesh.weight_store.locks); nothing here takes it.

Publication: shards and manifest go into `root/.tmp/<key>.<pid>.<uuid>` (same filesystem as
`root/v1/`), every file and the directory are fsynced, then one rename(2) makes the entry
appear whole, and the parent directory is fsynced so the rename survives a crash.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from stagemesh.weight_store.manifest import (
    Manifest,
    TensorRecord,
    file_record,
    hash_side_by_side,
    read_safetensors_header,
)
from stagemesh.weight_store.safetensors_writer import write_streamed
from stagemesh.weight_store.store import LAST_USE_FILE, MANIFEST_FILE, CacheStore

SHARD_MAX_BYTES = 2 * 1024**3
MIN_RESERVE_BYTES = 64 * 1024**2
SUPPORTED_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.int8,
    torch.float8_e4m3fn,  # 8-bit DLO streaming keeps quantised weights in the entry
)


class UnsupportedTensors(ValueError):
    """The tensors cannot be stored as one independent region each (aliases, views, strides)."""


def check_supported(tensors: dict[str, torch.Tensor]) -> None:
    """UnsupportedTensors unless every tensor is contiguous, owns its whole storage and shares
    it with no other tensor: a mapped copy of anything else would change what aliases what."""
    seen: dict[int, str] = {}
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise UnsupportedTensors(f"{name}: not a tensor ({type(t).__name__})")
        if t.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedTensors(f"{name}: dtype {t.dtype} is not supported")
        if not t.is_contiguous():
            raise UnsupportedTensors(f"{name}: non-contiguous (stride {tuple(t.stride())})")
        storage = t.untyped_storage()
        if t.storage_offset() != 0 or storage.nbytes() != t.numel() * t.element_size():
            raise UnsupportedTensors(f"{name}: a view into a larger storage ({storage.nbytes()} bytes)")
        if storage.nbytes() and storage.data_ptr() in seen:
            raise UnsupportedTensors(f"{name}: shares its storage with {seen[storage.data_ptr()]}")
        seen[storage.data_ptr()] = name


def entry_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def required_free_bytes(store: CacheStore, size: int, reserve_bytes: int | None) -> tuple[int, int]:
    """(needed, free) on the root's filesystem: entry size + max(64 MiB, 1 %) unless a reserve
    is given."""
    usage = shutil.disk_usage(store.root)
    reserve = reserve_bytes if reserve_bytes is not None else max(MIN_RESERVE_BYTES, usage.total // 100)
    return size + reserve, usage.free


def remove_stale_temps(store: CacheStore, key: str) -> list[Path]:
    """Temp directories of `key` left by publishers that died (we hold the lock: none is live)."""
    removed = []
    for path in sorted(store.temp_root.glob(f"{key}.*")):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def discard_entry(store: CacheStore, key: str) -> None:
    """Remove an entry: rename it out of v1/ first so nobody can start mapping a half-deleted one.
    Processes that mapped it keep their pages (the inodes live until unmapped)."""
    directory = store.entry_dir(key)
    if not directory.exists():
        return
    doomed = store.temp_root / f"{key}.{os.getpid()}.{uuid.uuid4().hex}.discard"
    os.rename(directory, doomed)
    _fsync_dir(store.layout_dir)
    shutil.rmtree(doomed, ignore_errors=True)


def write_entry(
    store: CacheStore,
    key: str,
    tensors: dict[str, torch.Tensor],
    temp: Path,
    shard_max_bytes: int = SHARD_MAX_BYTES,
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Write `tensors` into the (existing, empty) temp dir `temp` and publish it as the entry.
    `before_commit` runs right before the rename and may raise to abandon the publication (the
    publication lock was lost)."""
    groups = _shard_groups(tensors, shard_max_bytes)
    records: dict[str, TensorRecord] = {}
    paths = {}
    for index, names in enumerate(groups, start=1):
        file_name = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        path = temp / file_name
        specs = [(n, tuple(tensors[n].shape), tensors[n].dtype) for n in names]
        write_streamed(path, specs, (tensors[n] for n in names))  # fsyncs the file
        header = read_safetensors_header(path)
        for n in names:
            start, end = header[n]["data_offsets"]
            records[n] = TensorRecord(tuple(header[n]["shape"]), header[n]["dtype"], end - start, file_name)
        paths[file_name] = path
    names = sorted(paths)
    files = dict(zip(names, hash_side_by_side(lambda name: file_record(paths[name]), names)))
    manifest = Manifest(key=key, files=files, tensors=records, created_unix=time.time())
    _write_synced(temp / MANIFEST_FILE, manifest.to_json().encode())
    _write_synced(temp / LAST_USE_FILE, b"")
    _fsync_dir(temp)
    target = store.entry_dir(key)
    if before_commit is not None:
        before_commit()
    os.rename(temp, target)  # atomic on one filesystem; fails if a directory is already there
    _fsync_dir(store.layout_dir)
    return target


def _shard_groups(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Sorted names cut into shards of at most `limit` bytes (a bigger tensor gets its own)."""
    groups: list[list[str]] = [[]]
    used = 0
    for name in sorted(tensors):
        size = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and used + size > limit:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

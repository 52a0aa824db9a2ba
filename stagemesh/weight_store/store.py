"""The on-disk runtime-weight cache: layout and read-only inspection.

Layout (docs/CACHE.md "On-disk layout"; docs/DLO.md "Runtime-weight cache in DLO")::

    root/v1/<key>/            one published entry: sharded *.safetensors + manifest.json
    root/v1/<key>/last_use    touch-file; its mtime records the last consumer
    root/.tmp/<key>.<pid>.<uuid>   a publication in progress (or left behind by a dead one)
    root/locks/<key>.lock     publication lock (exclusive flock while a publisher works)
    root/locks/<key>.consumers   consumer lock (shared flock per live consumer)

The manifest lives in manifest.py, locks in locks.py, writing in publish.py, eviction in
evict.py. Plain Python, no gRPC: the server wraps it, tests use it directly.
"""

from __future__ import annotations

import os
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from stagemesh.core import errors
from stagemesh.weight_store import locks
from stagemesh.weight_store.locks import LOCK_DIR, is_valid_key
from stagemesh.weight_store.manifest import (  # noqa: F401 - re-exported: callers import them from here
    SCHEMA_VERSION,
    SHARD_SUFFIX,
    FileRecord,
    Manifest,
    ManifestError,
    TensorRecord,
    file_record,
    read_safetensors_header,
)

LAYOUT_DIR = "v1"
TEMP_DIR = ".tmp"
MANIFEST_FILE = "manifest.json"
LAST_USE_FILE = "last_use"
DIR_MODE = 0o700


def default_root() -> Path:
    """The cache root; deliberately independent of XDG_CACHE_HOME, HF_HOME and the like."""
    return Path("~/.cache/stagemesh/dlo-runtime-weights").expanduser()


@dataclass(frozen=True)
class EntryInfo:
    key: str
    size_bytes: int  # every regular file in the entry directory: what evicting it frees
    file_count: int  # shard (*.safetensors) files on disk
    tensor_count: int  # from the manifest; 0 when it does not parse
    last_used_unix: float
    live_consumers: int = 0
    valid: bool = False


@dataclass(frozen=True)
class StoreStats:
    root: str
    entry_count: int
    total_bytes: int
    invalid_entry_count: int
    stale_temp_dirs: int


@dataclass
class _DirScan:
    size_bytes: int = 0
    shard_count: int = 0
    last_use_mtime: float | None = None
    names: set[str] = field(default_factory=set)


class CacheStore:
    """Read-only view of a cache root; reading never creates anything."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @property
    def layout_dir(self) -> Path:
        return self.root / LAYOUT_DIR

    @property
    def temp_root(self) -> Path:
        return self.root / TEMP_DIR

    def entry_dir(self, key: str) -> Path:
        return self.layout_dir / key

    def new_temp_dir_path(self, key: str) -> Path:
        """A fresh temp path for publishing `key` (not created): same filesystem as the entry."""
        return self.temp_root / f"{key}.{os.getpid()}.{uuid.uuid4().hex}"

    def ensure_root(self) -> None:
        """Create the root (0700) and its subdirectories if missing; FailedPrecondition if unusable."""
        try:
            _make_private_dir(self.root)
        except FileExistsError:
            pass  # something other than a directory is there; reported just below
        except OSError as exc:
            raise errors.FailedPrecondition(f"cache root {self.root} cannot be created: {exc}") from exc
        if not self.root.is_dir():
            raise errors.FailedPrecondition(f"cache root {self.root} is not a directory")
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise errors.FailedPrecondition(f"cache root {self.root} is not readable and writable")
        _check_private(self.root, "cache root", follow=True)  # the root itself may be a link to another disk
        try:
            for sub in (self.layout_dir, self.temp_root, self.root / LOCK_DIR):
                _make_private_dir(sub)
        except OSError as exc:
            raise errors.FailedPrecondition(f"cache root {self.root}: cannot create {exc.filename}: {exc}") from exc
        for sub in (self.layout_dir, self.temp_root, self.root / LOCK_DIR):
            _check_private(sub, "cache directory")

    def entry_problems(self, key: str, *, deep: bool = True) -> list[str] | None:
        """None when no entry of `key` exists; else its problems ([] means valid). `deep` also
        hashes every file; without it only sizes and tensor headers are compared."""
        directory = self.entry_dir(locks.require_key(key))
        if not directory.is_dir():
            return None
        try:
            manifest = Manifest.from_json((directory / MANIFEST_FILE).read_bytes())
        except (OSError, ManifestError) as exc:
            return [f"{MANIFEST_FILE}: {exc}"]
        if manifest.key != key:
            return [f"{MANIFEST_FILE}: names key {manifest.key}"]
        return manifest.validate_files(directory, deep=deep)

    def list_entries(self) -> list[EntryInfo]:
        entries = []
        for name in sorted(self._subdirs(self.layout_dir)):
            info = self._entry_info(self.layout_dir / name)
            if info is not None:
                entries.append(info)
        return entries

    def stats(self) -> StoreStats:
        entries = self.list_entries()
        return StoreStats(
            root=str(self.root),
            entry_count=len(entries),
            total_bytes=sum(e.size_bytes for e in entries),
            invalid_entry_count=sum(1 for e in entries if not e.valid),
            stale_temp_dirs=len(self._subdirs(self.temp_root)),
        )

    def _subdirs(self, path: Path) -> list[str]:
        try:
            with os.scandir(path) as it:
                return [e.name for e in it if _is_dir(e)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise errors.FailedPrecondition(f"cannot read cache directory {path}: {exc}") from exc

    def _entry_info(self, path: Path) -> EntryInfo | None:
        """One entry's info, or None when its directory vanished (evicted) during the scan."""
        try:
            dir_mtime = path.stat().st_mtime
            scan = _scan_dir(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:
            return EntryInfo(key=path.name, size_bytes=0, file_count=0, tensor_count=0, last_used_unix=0.0)
        manifest = _read_manifest(path) if MANIFEST_FILE in scan.names else None
        if not path.is_dir():
            return None  # gone between the scan and the manifest read
        valid = manifest is not None and manifest.key == path.name and is_valid_key(path.name)
        return EntryInfo(
            key=path.name,
            size_bytes=scan.size_bytes,
            file_count=scan.shard_count,
            tensor_count=len(manifest.tensors) if manifest is not None else 0,
            last_used_unix=max(dir_mtime, scan.last_use_mtime or 0.0),
            live_consumers=locks.live_consumers(self.root, path.name) if is_valid_key(path.name) else 0,
            valid=valid,
        )


def _check_private(path: Path, what: str, follow: bool = False) -> None:
    """Refuse a directory another user could have filled or can change: entries found there would
    be mapped as weights. A symlink is refused too (it may point anywhere)."""
    st = os.stat(path, follow_symlinks=follow)
    if stat.S_ISLNK(st.st_mode):
        raise errors.FailedPrecondition(
            f"{what} {path} is a symlink; replace it with a directory (mkdir -m 700 {path})"
        )
    uid = os.geteuid()
    if st.st_uid != uid:
        raise errors.FailedPrecondition(
            f"{what} {path} is owned by uid {st.st_uid}, not this user (uid {uid}); "
            f"use a root of your own, or `chown -R {uid} {path}` if its content is trusted"
        )
    if st.st_mode & 0o077:
        raise errors.FailedPrecondition(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: others may change or read it; "
            f"`chmod 700 {path}` if its content is trusted, or use a fresh root"
        )


def _make_private_dir(path: Path) -> None:
    """mkdir -p where every directory this call creates is 0700 (weights are private data)."""
    missing = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue  # created concurrently by another process
        os.chmod(directory, DIR_MODE)  # mkdir's mode is filtered by the umask


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _scan_dir(path: Path) -> _DirScan:
    scan = _DirScan()
    with os.scandir(path) as it:
        for entry in it:
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we looked
            scan.names.add(entry.name)
            scan.size_bytes += st.st_size
            if entry.name.endswith(SHARD_SUFFIX):
                scan.shard_count += 1
            elif entry.name == LAST_USE_FILE:
                scan.last_use_mtime = st.st_mtime
    return scan


def _read_manifest(path: Path) -> Manifest | None:
    try:
        return Manifest.from_json((path / MANIFEST_FILE).read_bytes())
    except (OSError, ManifestError):
        return None

"""The on-disk runtime-weight cache: layout, manifest schema and read-only inspection.

Layout (DESIGN §4.3)::

    root/v1/<key>/            one published entry: sharded *.safetensors + manifest.json
    root/v1/<key>/last_use    optional touch-file; its mtime records the last consumer
    root/.tmp/<key>.<pid>.<uuid>   a publication in progress (or left behind by a dead one)

Plain Python, no gRPC: the server wraps it, tests use it directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagemesh import errors

SCHEMA_VERSION = 1
LAYOUT_DIR = "v1"
TEMP_DIR = ".tmp"
MANIFEST_FILE = "manifest.json"
LAST_USE_FILE = "last_use"
SHARD_SUFFIX = ".safetensors"

_KEY_RE = re.compile(r"[0-9a-f]{64}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_HASH_CHUNK = 1 << 20
# A safetensors header is JSON behind an 8-byte length; cap it so a corrupt length cannot
# make validation read a whole shard into memory.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def default_root() -> Path:
    """The cache root; deliberately independent of XDG_CACHE_HOME, HF_HOME and the like."""
    return Path("~/.cache/stagemesh/dlo-runtime-weights").expanduser()


def is_valid_key(key: str) -> bool:
    return bool(_KEY_RE.fullmatch(key))


class ManifestError(ValueError):
    """manifest.json is missing a field, has a wrong type or an unknown schema."""


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str


@dataclass(frozen=True)
class TensorRecord:
    shape: tuple[int, ...]
    dtype: str  # the safetensors dtype name, e.g. "BF16", as in the shard's own header
    nbytes: int
    file: str


@dataclass(frozen=True)
class Manifest:
    key: str
    files: dict[str, FileRecord]
    tensors: dict[str, TensorRecord]
    created_unix: float
    schema: int = SCHEMA_VERSION

    def to_json(self) -> str:
        doc = {
            "schema": self.schema,
            "key": self.key,
            "files": {n: {"size": f.size, "sha256": f.sha256} for n, f in sorted(self.files.items())},
            "tensors": {
                n: {"shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes, "file": t.file}
                for n, t in sorted(self.tensors.items())
            },
            "created_unix": self.created_unix,
        }
        return json.dumps(doc, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"not JSON: {exc}") from exc
        _expect(isinstance(doc, dict), "top level is not an object")
        schema = doc.get("schema")
        _expect(schema == SCHEMA_VERSION, f"unsupported schema {schema!r}")
        key = doc.get("key")
        _expect(isinstance(key, str), "key is not a string")
        created = doc.get("created_unix")
        _expect(_is_number(created), "created_unix is not a number")
        files = {name: _file_record(name, raw) for name, raw in _object(doc, "files").items()}
        tensors = {name: _tensor_record(name, raw) for name, raw in _object(doc, "tensors").items()}
        return cls(key=key, files=files, tensors=tensors, created_unix=float(created), schema=schema)

    def validate_files(self, directory: str | os.PathLike) -> list[str]:
        """Problems found comparing this manifest with the files in `directory`; [] if none.

        Checks every listed file's size and SHA-256, that tensors name listed files, that
        each tensor's dtype, shape and byte count match the shard header, and that no
        shard lies in the directory unlisted.
        """
        directory = Path(directory)
        problems: list[str] = []
        for name, record in sorted(self.files.items()):
            problems.extend(_check_file(directory, name, record))
        for name, tensor in sorted(self.tensors.items()):
            if tensor.file not in self.files:
                problems.append(f"tensor {name}: file {tensor.file!r} is not listed")
        if not problems:
            problems.extend(self._check_headers(directory))
        problems.extend(_unlisted_shards(directory, self.files))
        return problems

    def _check_headers(self, directory: Path) -> list[str]:
        problems: list[str] = []
        by_file: dict[str, dict[str, TensorRecord]] = {}
        for name, tensor in self.tensors.items():
            by_file.setdefault(tensor.file, {})[name] = tensor
        for file_name, tensors in sorted(by_file.items()):
            try:
                header = read_safetensors_header(directory / file_name)
            except (OSError, ValueError) as exc:
                problems.append(f"{file_name}: unreadable safetensors header: {exc}")
                continue
            for name, tensor in sorted(tensors.items()):
                problems.extend(_check_tensor(file_name, name, tensor, header.get(name)))
        return problems


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ManifestError(message)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _object(doc: dict, name: str) -> dict:
    value = doc.get(name)
    _expect(isinstance(value, dict), f"{name} is not an object")
    return value


def _safe_file_name(name: str) -> bool:
    # Names come from disk; a path separator or ".." would let a manifest point outside its entry.
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def _file_record(name: str, raw: Any) -> FileRecord:
    _expect(_safe_file_name(name), f"files: bad file name {name!r}")
    _expect(isinstance(raw, dict), f"files[{name}] is not an object")
    size, sha = raw.get("size"), raw.get("sha256")
    _expect(_is_count(size), f"files[{name}].size is not a non-negative integer")
    _expect(isinstance(sha, str) and bool(_SHA256_RE.fullmatch(sha)), f"files[{name}].sha256 is not lowercase hex")
    return FileRecord(size=size, sha256=sha)


def _tensor_record(name: str, raw: Any) -> TensorRecord:
    _expect(isinstance(raw, dict), f"tensors[{name}] is not an object")
    shape, dtype, nbytes, file = raw.get("shape"), raw.get("dtype"), raw.get("bytes"), raw.get("file")
    shape_ok = isinstance(shape, list) and all(_is_count(d) for d in shape)
    _expect(shape_ok, f"tensors[{name}].shape is not a list of sizes")
    _expect(isinstance(dtype, str) and bool(dtype), f"tensors[{name}].dtype is not a string")
    _expect(_is_count(nbytes), f"tensors[{name}].bytes is not a non-negative integer")
    _expect(isinstance(file, str), f"tensors[{name}].file is not a string")
    return TensorRecord(shape=tuple(shape), dtype=dtype, nbytes=nbytes, file=file)


def file_record(path: str | os.PathLike) -> FileRecord:
    """Size and SHA-256 of one file, as the manifest records them."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileRecord(size=size, sha256=digest.hexdigest())


def read_safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors file's header."""
    with open(path, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) != 8:
            raise ValueError("file shorter than the header length")
        (length,) = struct.unpack("<Q", raw_len)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"header length {length} is implausible")
        raw = fh.read(length)
    if len(raw) != length:
        raise ValueError("header truncated")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    header.pop("__metadata__", None)
    return header


def _check_file(directory: Path, name: str, record: FileRecord) -> list[str]:
    path = directory / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [f"{name}: missing"]
    if not path.is_file():
        return [f"{name}: not a regular file"]
    if size != record.size:
        return [f"{name}: size {size} != manifest {record.size}"]
    actual = file_record(path)
    if actual.sha256 != record.sha256:
        return [f"{name}: sha256 {actual.sha256} != manifest {record.sha256}"]
    return []


def _check_tensor(file_name: str, name: str, tensor: TensorRecord, entry: Any) -> list[str]:
    if not isinstance(entry, dict):
        return [f"tensor {name}: not in {file_name}"]
    problems = []
    if entry.get("dtype") != tensor.dtype:
        problems.append(f"tensor {name}: dtype {entry.get('dtype')!r} in {file_name} != manifest {tensor.dtype!r}")
    if list(entry.get("shape", [])) != list(tensor.shape):
        problems.append(f"tensor {name}: shape {entry.get('shape')} in {file_name} != manifest {list(tensor.shape)}")
    offsets = entry.get("data_offsets")
    span = offsets[1] - offsets[0] if isinstance(offsets, list) and len(offsets) == 2 else None
    if span != tensor.nbytes:
        problems.append(f"tensor {name}: {span} bytes in {file_name} != manifest {tensor.nbytes}")
    return problems


def _unlisted_shards(directory: Path, listed: dict[str, FileRecord]) -> list[str]:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [f"{n}: shard not listed in the manifest" for n in names if n.endswith(SHARD_SUFFIX) and n not in listed]


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
        """Create the root if missing and check it can hold entries; FailedPrecondition if not."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            pass  # something other than a directory is there; reported just below
        except OSError as exc:
            raise errors.FailedPrecondition(f"cache root {self.root} cannot be created: {exc}") from exc
        if not self.root.is_dir():
            raise errors.FailedPrecondition(f"cache root {self.root} is not a directory")
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise errors.FailedPrecondition(f"cache root {self.root} is not readable and writable")

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
            valid=valid,
        )


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

"""Where each tensor lies in a safetensors file, and zero-copy views of those bytes.

`read_index` reads only the header and checks it against the file (header length, offsets
consistent with shape and dtype, data inside the file); with `validate=True` safetensors' own
reader must also open the file and agree on the names, so any loader that reads it later accepts
it. Sleep (level-2 wake) and the DLO mmap plan both read checkpoints through it.
`map_file` / `map_tensors` give views through a read-only shared memory map: no copy until they are copied
to their destination, and the file's page cache serves them; `file_version` tells whether a
mapping still shows the file now at its path.
"""

from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

# Re-exported: CheckpointError has always been imported from here.
from stagemesh.weight_store.errors import CheckpointError as CheckpointError
from stagemesh.weight_store.safetensors_header import HeaderError, read_header

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file_offset: int  # absolute, from the start of the file
    nbytes: int
    path: Path  # the file that holds the bytes


def _record(path: Path, name: str, info, base: int, size: int) -> TensorRecord:
    try:
        dtype = DTYPES.get(info["dtype"])
        start, end = (int(x) for x in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: {name} has a malformed header entry") from None
    if dtype is None:
        raise CheckpointError(f"{path}: {name} has unsupported dtype {info['dtype']!r}")
    numel = 1
    for d in shape:
        numel *= d
    if end - start != numel * dtype.itemsize or start < 0 or base + end > size:
        raise CheckpointError(f"{path}: {name} has inconsistent data offsets")
    return TensorRecord(name, dtype, shape, base + start, end - start, path)


def _names_by_safetensors(path: Path) -> set[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return set(f.keys())
    except Exception as exc:  # noqa: BLE001 - its own error types; the message says why
        raise CheckpointError(f"{path}: safetensors refuses the file ({exc})") from None


def read_index(path: str | Path, *, validate: bool = False) -> dict[str, TensorRecord]:
    """Where each tensor's bytes lie in a safetensors file (reads only the header)."""
    path = Path(path)
    size = path.stat().st_size
    try:
        header, base = read_header(path)
    except HeaderError as exc:
        raise CheckpointError(str(exc)) from None
    records = {name: _record(path, name, info, base, size) for name, info in header.items()}
    if validate and _names_by_safetensors(path) != set(records):
        raise CheckpointError(f"{path}: header and safetensors disagree on tensor names")
    return records


def map_file(path: str | Path) -> torch.Tensor:
    """The whole file as a flat uint8 CPU tensor over a read-only shared mapping: its pages are
    the page cache every process shares. Read-only and shared (not a private copy-on-write
    mapping) so the pages can be page-locked in place: a long-term pin of a private mapping makes
    the kernel copy every page first. Weights are never written; a write would fault."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return map_descriptor(fd)
    finally:
        os.close(fd)


def map_descriptor(fd: int) -> torch.Tensor:
    """`map_file` of the file open as `fd` (which the caller may close afterwards): the very file
    whose version (`file_version(os.fstat(fd))`) the caller has checked."""
    size = os.fstat(fd).st_size
    if not size:
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive


FileVersion = tuple[int, int, int, int, int]


def file_version(st: os.stat_result) -> FileVersion:
    """What tells one version of a file from another: a file renamed over the path is another
    inode; one rewritten in place has another size, or another modification and change time
    (the change time cannot be set back; both move in ticks of the file system's clock, so a
    rewrite within the tick of the write before it keeps them)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def record_view(data: torch.Tensor, r: TensorRecord) -> torch.Tensor:
    """The tensor `r` describes, viewed in `data` (the file mapped by map_file)."""
    if not r.nbytes:
        return torch.empty(r.shape, dtype=r.dtype)
    return data[r.file_offset : r.file_offset + r.nbytes].view(r.dtype).view(r.shape)


def map_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """name -> CPU tensor viewing the file's bytes (the file is never modified)."""
    data = map_file(path)
    return {name: record_view(data, r) for name, r in read_index(path).items()}

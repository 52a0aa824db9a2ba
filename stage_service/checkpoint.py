"""Zero-copy views of the tensors in a safetensors file, through a private memory map.

Used where weights must come back from the checkpoint fast (wake from sleep level 2): the views
cost no copy until they are copied to their destination, and the file's page cache serves them.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file_offset: int  # absolute, from the start of the file
    nbytes: int


def read_index(path: str | Path) -> dict[str, TensorRecord]:
    """Where each tensor's bytes lie in a safetensors file (reads only the header)."""
    path = Path(path)
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (header_len,) = struct.unpack("<Q", raw_len)
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    records = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        records[name] = TensorRecord(name, dtype, tuple(info["shape"]), base + start, end - start)
    return records


def map_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """name -> CPU tensor viewing the file's bytes (copy-on-write: the file is never modified)."""
    path = Path(path)
    records = read_index(path)
    size = path.stat().st_size
    if not size:
        return {}
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    data = torch.frombuffer(mapping, dtype=torch.uint8)
    tensors: dict[str, torch.Tensor] = {}
    for name, r in records.items():
        if r.file_offset + r.nbytes > size:
            raise CheckpointError(f"{path}: {name} lies beyond the end of the file")
        raw = data[r.file_offset:r.file_offset + r.nbytes]
        tensors[name] = raw.view(r.dtype).reshape(r.shape) if r.nbytes else torch.empty(r.shape, dtype=r.dtype)
    return tensors

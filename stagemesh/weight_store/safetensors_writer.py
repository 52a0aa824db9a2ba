"""Write a safetensors file one tensor at a time.

`safetensors.torch.save_file` needs every tensor in memory at once; generating a 12B-parameter
model that way would need its full size in RAM. The format is simple enough to stream: an 8-byte
little-endian header length, a JSON header with byte offsets, then the raw tensor bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

_CODES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


def _header(specs: list[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    offset = 0
    for name, shape, dtype in specs:
        if dtype not in _CODES:
            raise ValueError(f"{name}: dtype {dtype} is not supported")
        if name in entries:
            raise ValueError(f"duplicate tensor name {name!r}")
        size = math.prod(shape) * dtype.itemsize
        entries[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    # Pad with spaces so the data section starts 8-byte aligned (readers may mmap it).
    return raw + b" " * (-len(raw) % 8)


def write_streamed(
    path: Path, specs: list[TensorSpec], tensors: Iterable[torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write `tensors` (in `specs` order, each matching its spec) to `path` and fsync it.

    A count mismatch raises ValueError. Only one tensor is held at a time, so peak memory is
    the largest tensor, not the file.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; big-endian hosts are unsupported")
    header = _header(specs, metadata)
    # 0600 like every other file of the cache: weights are private data.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for (name, shape, dtype), t in zip(specs, tensors, strict=True):
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}")
            flat = t.detach().to("cpu").contiguous().reshape(-1)
            if flat.numel():
                f.write(flat.view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())

"""The JSON header of a safetensors file (no torch needed: the cache service reads it too)."""

from __future__ import annotations

import json
import os
import struct

# A corrupt length must not make a reader load a whole shard into memory.
MAX_HEADER_BYTES = 100 * 1024 * 1024


class HeaderError(ValueError):
    pass


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(tensor name -> {"dtype", "shape", "data_offsets"}, offset where the data starts).
    The "__metadata__" entry is left out."""
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise HeaderError(f"{path}: too short for a safetensors file")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise HeaderError(f"{path}: header length {header_len} exceeds the file")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise HeaderError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + header_len

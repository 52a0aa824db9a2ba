"""Tensor <-> stagemesh.v1.Tensor conversion (raw little-endian bytes, any torch dtype)."""

from __future__ import annotations

import torch

from stagemesh.core.errors import InvalidArgument
from stagemesh.v1 import tensor_pb2

_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "bool",
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's own elements as a flat uint8 CPU tensor (a view when already contiguous on
    the CPU; otherwise one copy of just this view, never its whole storage)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def to_proto(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    raw = host_bytes(tensor).numpy().tobytes()
    return tensor_pb2.Tensor(dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), data=raw)


def from_proto(message: tensor_pb2.Tensor, field: str = "tensor") -> torch.Tensor:
    dtype = _DTYPES.get(message.dtype)
    if dtype is None:
        raise InvalidArgument.field(f"{field}.dtype", f"unknown dtype {message.dtype!r}; allowed: {sorted(_DTYPES)}")
    shape = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument.field(f"{field}.shape", "dimensions must be >= 0")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = itemsize
    for d in shape:
        expected *= d
    if len(message.data) != expected:
        raise InvalidArgument.field(
            f"{field}.data", f"holds {len(message.data)} bytes, shape {list(shape)} of {message.dtype} needs {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(message.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)

"""torch.Tensor <-> stagemesh.v1.Tensor for the stage service. The message format and the checks
on what arrives are stagemesh.core.codec's (torch-free, shared with the gateway)."""

from __future__ import annotations

import torch

from stagemesh.core import codec
from stagemesh.v1 import tensor_pb2

_DTYPES = {name: getattr(torch, name) for name in codec.DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's own elements as a flat uint8 CPU tensor (a view when already contiguous on
    the CPU; otherwise one copy of just this view, never its whole storage)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def image_pixels(image: torch.Tensor) -> torch.Tensor:
    """An [H, W, 3] float image in [0, 1] as the uint8 pixels the gateway's encoder makes of it
    (codec.to_pixels, the same arithmetic, so the encoded bytes do not change). An image for
    PNG, JPEG or WebP then travels at a quarter of its float32 size."""
    return torch.from_numpy(codec.to_pixels(image.detach().to("cpu", torch.float32).contiguous().numpy()))


def to_proto(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    raw = host_bytes(tensor).numpy().tobytes()
    return tensor_pb2.Tensor(dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), data=raw)


def from_proto(message: tensor_pb2.Tensor, field: str = "tensor") -> torch.Tensor:
    shape = codec.checked_shape(message, field)
    dtype = _DTYPES[message.dtype]
    if not message.data:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(message.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)

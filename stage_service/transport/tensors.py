"""torch.Tensor <-> stagemesh.v1.Tensor for the stage service. The message format and the checks
on what arrives are stagemesh.core.codec's (torch-free, shared with the gateway)."""

from __future__ import annotations

import torch

from stagemesh.core import codec, shared_tensors
from stagemesh.core.params import OUTPUT_TENSOR
from stagemesh.v1 import tensor_pb2

_DTYPES = {name: getattr(torch, name) for name in codec.DTYPES}
# The outputs the gateway encodes (PNG, JPEG, WebP; MP4, animated WebP) unless the client asked
# for the tensor: an image [H, W, 3] and a video's frames [frames, H, W, 3], float in [0, 1].
PIXEL_OUTPUTS = ("image", "video")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's own elements as a flat uint8 CPU tensor (a view when already contiguous on
    the CPU; otherwise one copy of just this view, never its whole storage)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def pixels(picture: torch.Tensor) -> torch.Tensor:
    """Float in [0, 1] -> uint8 on the picture's own device, with codec.to_pixels' arithmetic
    (scaled in float32, rounded half to even, clamped), so the bytes are the same wherever it
    runs: on a GPU, before the copy to the host, a quarter of the float32 bytes cross it."""
    scaled = picture.to(torch.float32) * 255.0
    return scaled.round_().clamp_(0, 255).to(torch.uint8)


def encoded_form(outputs: dict[str, torch.Tensor], output_format: str) -> dict[str, torch.Tensor]:
    """The outputs as they need to travel for `output_format`: an image or video the gateway will
    encode as its uint8 pixels (the bytes its encoder would make of them); the tensor format,
    and every other output, as they are."""
    if output_format == OUTPUT_TENSOR:
        return outputs
    return {name: pixels(t) if name in PIXEL_OUTPUTS and t.is_floating_point() else t for name, t in outputs.items()}


def to_proto(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    raw = host_bytes(tensor).numpy().tobytes()
    return tensor_pb2.Tensor(dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), data=raw)


def to_shared_proto(tensor: torch.Tensor, owner_pid: int) -> tensor_pb2.Tensor:
    """The tensor's bytes in a new shared-memory segment, named in the message (the reader owns
    it: core/shared_tensors.py)."""
    name = shared_tensors.export(host_bytes(tensor).numpy().data, owner_pid)
    return tensor_pb2.Tensor(dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), shm_name=name)


def from_proto(message: tensor_pb2.Tensor, field: str = "tensor") -> torch.Tensor:
    shape = codec.checked_shape(message, field)
    dtype = _DTYPES[message.dtype]
    data = codec.payload(message, field)  # a segment's: mapped privately, no copy
    if not len(data):
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(data if message.shm_name else bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)

"""Tensor packing for the worker -> executor queues.

Tensors travel as raw bytes plus dtype and shape, never as torch objects: pickling a tensor
through a multiprocessing queue would route it through torch's shared-memory reducers, whose
segments we could not account for. Containers are walked recursively into new containers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedTensor:
    dtype: str
    shape: tuple[int, ...]
    data: bytes


def _pack_tensor(tensor: torch.Tensor) -> PackedTensor:
    # contiguous() copies only this view's elements, so a slice of a batch ships its own bytes.
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return PackedTensor(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data)


def _unpack_tensor(packed: PackedTensor) -> torch.Tensor:
    dtype = getattr(torch, packed.dtype)
    if not packed.data:
        return torch.empty(packed.shape, dtype=dtype)
    return torch.frombuffer(bytearray(packed.data), dtype=torch.uint8).view(dtype).reshape(packed.shape)


def pack(obj):
    if isinstance(obj, torch.Tensor):
        return _pack_tensor(obj)
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(v) for v in obj)
    return obj


def unpack(obj):
    if isinstance(obj, PackedTensor):
        return _unpack_tensor(obj)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(v) for v in obj)
    return obj

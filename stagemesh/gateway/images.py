"""Turning a decoded image tensor into what the client asked for."""

from __future__ import annotations

import io

import torch
from PIL import Image


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    """[H, W, 3] float in [0, 1] -> uint8, rounding half away from zero deterministically."""
    return (image.float() * 255.0).round().clamp(0, 255).to(torch.uint8)


def encode_png(image: torch.Tensor) -> bytes:
    pixels = to_uint8(image).contiguous().numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()

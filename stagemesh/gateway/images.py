"""Turning a decoded image array into what the client asked for."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def to_uint8(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] float in [0, 1] -> uint8: scaled in float32, rounded half to even, clamped."""
    return (image.astype(np.float32, copy=False) * np.float32(255.0)).round().clip(0, 255).astype(np.uint8)


def encode_png(image: np.ndarray) -> bytes:
    pixels = np.ascontiguousarray(to_uint8(image))
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()

"""The gateway's image codecs: results as PNG, JPEG and WebP; a client's starting image read
with every refusal naming params.init_image (real Pillow, real bytes)."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from stagemesh.core.errors import InvalidArgument
from stagemesh.core.params import Limits
from stagemesh.gateway.images import decode_init_image, encode, probe_init_image

LIMITS = Limits(pixel_multiple=16, max_pixels_side=512)


def _picture(width: int = 64, height: int = 48) -> np.ndarray:
    ys, xs = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
    return np.stack([xs, ys, 1 - xs], axis=-1).astype(np.float32)


def _file(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _refusal(data: bytes) -> str:
    with pytest.raises(InvalidArgument) as info:
        decode_init_image(probe_init_image(data, LIMITS))
    [violation] = info.value.violations
    assert violation.field == "params.init_image"
    assert "allowed" in violation.description
    return violation.description


@pytest.mark.parametrize("fmt,pil", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_results_decode_with_pillow_at_their_size(fmt, pil):
    data = encode(_picture(), fmt, 90)
    with Image.open(io.BytesIO(data)) as image:
        assert (image.format, image.size, image.mode) == (pil, (64, 48), "RGB")
        pixels = np.asarray(image).astype(np.float32) / 255
    tolerance = 0 if fmt == "png" else 0.05  # lossy formats: close, not equal
    assert np.abs(pixels - (_picture() * 255).round() / 255).mean() <= tolerance + 1e-6


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_quality_trades_size_for_fidelity(fmt):
    noisy = np.random.default_rng(0).random((64, 64, 3), dtype=np.float32)
    assert len(encode(noisy, fmt, 10)) < len(encode(noisy, fmt, 95))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_a_starting_image_decodes_to_rgb_pixels(fmt, mode):
    if fmt == "JPEG" and mode in ("RGBA", "P"):
        pytest.skip("JPEG holds no alpha or palette")
    rgb = Image.fromarray((_picture(32, 16) * 255).round().astype(np.uint8))
    data = _file(rgb.convert(mode), fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    probed = probe_init_image(data, LIMITS)
    assert (probed.width, probed.height, probed.data) == (32, 16, data)
    pixels = decode_init_image(probed)
    assert pixels.dtype == np.uint8 and pixels.shape == (16, 32, 3)
    if fmt != "JPEG" and mode in ("RGB", "RGBA"):
        assert np.array_equal(pixels, np.asarray(rgb))


def test_what_is_no_allowed_image_is_refused_naming_the_field():
    assert "not a PNG, JPEG or WebP image" in _refusal(b"hello, not an image")
    assert "not a PNG, JPEG or WebP image" in _refusal(b"")
    gif = _file(Image.new("RGB", (16, 16)), "GIF")
    assert "not a PNG, JPEG or WebP image" in _refusal(gif)  # no other format's reader sees the bytes
    bmp = _file(Image.new("RGB", (16, 16)), "BMP")
    assert "not a PNG, JPEG or WebP image" in _refusal(bmp)


def test_a_truncated_image_is_refused_when_decoded():
    noise = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    whole = _file(Image.fromarray(noise), "PNG")
    description = _refusal(whole[: len(whole) // 2])
    assert "cannot be decoded" in description


def test_a_picture_larger_than_the_pipeline_draws_is_refused_from_its_header():
    big = _file(Image.new("RGB", (528, 16)), "PNG")
    assert "528x16" in _refusal(big) and "up to 512" in _refusal(big)


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG header declaring width x height grey pixels over a few KB of zlib: a huge picture."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])  # 8-bit grey
    compressor = zlib.compressobj(9)
    row = b"\x00" * (width + 1)
    data = b"".join(compressor.compress(row) for _ in range(64)) + compressor.flush()  # truncated rows
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_before_it_is_inflated():
    bomb = _bomb_png(50_000, 50_000)  # 2.5 G pixels declared in a few KB
    assert len(bomb) < 10_000
    description = _refusal(bomb)
    assert "decompression bomb" in description or "50000x50000" in description

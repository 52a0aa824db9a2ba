"""The request features over the HTTP API, with the official `openai` SDK against a real mesh:
`n` images drawn at seed + index, JPEG and WebP with output_compression, and /v1/images/edits
redrawing a starting image (closer to it at a low strength than at strength 1)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from openai import OpenAI
from PIL import Image

from tests.gateway.http.conftest import API_KEY

pytestmark = pytest.mark.mesh


@pytest.fixture
def sdk(base_url) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _decoded(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def _rgb(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.float32) / 255


def _picture(size: int) -> bytes:
    """A PNG with structure (colour gradients and a bright disc)."""
    ys, xs = np.meshgrid(np.linspace(0, 1, size), np.linspace(0, 1, size), indexing="ij")
    disc = (((xs - 0.6) ** 2 + (ys - 0.4) ** 2) < 0.05).astype(float)
    pixels = (np.stack([xs, ys, disc], axis=-1) * 255).round().astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_n_images_are_drawn_at_seed_plus_index_and_differ(sdk):
    reply = sdk.images.generate(
        prompt="a lighthouse", size="32x32", n=2, extra_body={"seed": 11, "num_inference_steps": 2}
    )
    assert len(reply.data) == 2
    assert [d.model_extra["seed"] for d in reply.data] == [11, 12]
    first, second = (_rgb(_decoded(d.b64_json)) for d in reply.data)
    assert first.shape == second.shape == (32, 32, 3) and not np.array_equal(first, second)
    # The second image is the one seed + 1 draws alone.
    alone = sdk.images.generate(prompt="a lighthouse", size="32x32", extra_body={"seed": 12, "num_inference_steps": 2})
    assert alone.data[0].b64_json == reply.data[1].b64_json


@pytest.mark.parametrize("output_format, pil", [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_jpeg_and_webp_decode_as_that_format_at_the_size_asked(sdk, output_format, pil):
    def draw(compression: int) -> bytes:
        reply = sdk.images.generate(
            prompt="a lighthouse",
            size="64x48",
            output_format=output_format,
            output_compression=compression,
            extra_body={"seed": 3, "num_inference_steps": 2},
        )
        assert reply.output_format == output_format
        return base64.b64decode(reply.data[0].b64_json)

    fine, coarse = draw(95), draw(5)
    for data in (fine, coarse):
        with Image.open(io.BytesIO(data)) as image:
            assert (image.format, image.size) == (pil, (64, 48))
    assert len(coarse) < len(fine)  # output_compression reaches the encoder


def test_an_edit_stays_closer_to_its_image_at_a_low_strength(sdk):
    start = _picture(64)
    target = _rgb(Image.open(io.BytesIO(start)))

    def edit(strength: float) -> np.ndarray:
        reply = sdk.images.edit(
            image=("start.png", start, "image/png"),
            prompt="the same, at night",
            size="64x64",
            extra_body={"seed": 9, "num_inference_steps": 10, "strength": strength},
        )
        image = _decoded(reply.data[0].b64_json)
        assert (image.format, image.size) == ("PNG", (64, 64))
        return _rgb(image)

    near = float(np.abs(edit(0.3) - target).mean())
    far = float(np.abs(edit(1.0) - target).mean())
    assert near < far, (near, far)

"""The stage's torch side of the tensor codec, and its agreement with the gateway's numpy side."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stagemesh.core import codec
from stagemesh.core.errors import InvalidArgument
from stagemesh.gateway.images import to_uint8
from stagemesh.stage_service.transport import tensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip(dtype):
    t = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) - 5).to(dtype)
    view = t.transpose(0, 2)  # non-contiguous
    back = tensors.from_proto(tensors.to_proto(view))
    assert back.dtype == dtype and back.shape == view.shape and torch.equal(back, view)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gateway_reads_what_the_stage_wrote(dtype):
    t = (torch.linspace(-3, 3, 24).reshape(2, 3, 4) * 7).to(dtype)
    array = codec.to_array(tensors.to_proto(t))
    want = t.float().numpy() if dtype == torch.bfloat16 else t.numpy()
    assert array.dtype == want.dtype and np.array_equal(array, want)


def test_the_stage_reads_what_the_gateway_wrote():
    array = np.linspace(0, 1, 24, dtype=np.float32).reshape(2, 3, 4)
    assert torch.equal(tensors.from_proto(codec.from_array(array)), torch.from_numpy(array))


def test_refusals_are_the_shared_checks():
    message = tensors.to_proto(torch.zeros(2, 2))
    message.data = message.data[:-1]
    with pytest.raises(InvalidArgument, match="needs 16") as info:
        tensors.from_proto(message, "inputs[x]")
    assert info.value.violations[0].field == "inputs[x].data"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gateway_pixels_equal_torch_rounding(dtype):
    """The gateway turns images into pixels with numpy; the stage's torch would round the same way
    (half to even, in float32), near the .5 boundaries too."""
    halves = torch.tensor([(k + 0.5) / 255.0 for k in range(255)], dtype=torch.float32)
    grid = torch.cat([torch.rand(3 * 64 * 64 - 255, generator=torch.Generator().manual_seed(0)) * 1.2 - 0.1, halves])
    image = grid.reshape(64, 64, 3).to(dtype)
    by_torch = (image.float() * 255.0).round().clamp(0, 255).to(torch.uint8).numpy()
    assert np.array_equal(to_uint8(codec.to_array(tensors.to_proto(image))), by_torch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pixels_made_by_the_stage_are_the_gateways(dtype):
    """tensors.pixels (on the worker's device) gives the bytes the gateway's to_uint8 makes of the
    float image, near the .5 boundaries and outside [0, 1] too, also from a permuted view."""
    halves = torch.tensor([(k + 0.5) / 255.0 for k in range(255)], dtype=torch.float32)
    grid = torch.cat([torch.rand(3 * 64 * 64 - 255, generator=torch.Generator().manual_seed(1)) * 1.4 - 0.2, halves])
    planar = grid.reshape(3, 64, 64).to(dtype)
    image = planar.permute(1, 2, 0)  # as the runners hand it on: [H, W, 3] over [3, H, W]
    got = tensors.pixels(image)
    assert got.dtype == torch.uint8 and got.shape == image.shape
    assert np.array_equal(got.contiguous().numpy(), to_uint8(image.float().contiguous().numpy()))


def test_encoded_form_turns_only_pictures_to_encode_into_pixels():
    video, image, latents = torch.rand(5, 8, 8, 3), torch.rand(8, 8, 3), torch.rand(4, 2, 2)
    outputs = {"video": video, "image": image, "latents": latents}
    assert tensors.encoded_form(outputs, "tensor") is outputs
    encoded = tensors.encoded_form(outputs, "mp4")
    assert {k: t.dtype for k, t in encoded.items()} == {
        "video": torch.uint8,
        "image": torch.uint8,
        "latents": torch.float32,
    }
    assert np.array_equal(encoded["video"].numpy(), to_uint8(video.numpy()))
    assert encoded["latents"] is latents
    pixels = tensors.encoded_form({"image": encoded["image"]}, "png")["image"]
    assert pixels is encoded["image"]  # uint8 pixels pass as they are

"""The default mesh serves the shipped trained weights: its pictures, through the gateway as PNG,
show what their prompts name (read back as in tests/stage_service/models/test_trained_model.py)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy
import pytest
import torch
from PIL import Image

from stagemesh.stage_service.models.weights import CHECKSUM_FILE, TRAINED_DIR
from stagemesh.v1 import gateway_pb2, generation_pb2
from training import shapes

pytestmark = pytest.mark.mesh


def _picture(mesh, prompt: str, seed: int, negative: str = "") -> shapes.Reading:
    params = generation_pb2.GenerationParams(
        prompt=prompt, negative_prompt=negative, width=64, height=64, num_inference_steps=8, seed=seed
    )
    with mesh.channel() as channel:
        reply = mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=120)
    pixels = numpy.array(Image.open(io.BytesIO(reply.result.png)).convert("RGB"))
    return shapes.read_picture(torch.from_numpy(pixels))


def test_the_default_mesh_draws_what_the_prompt_names(mesh, model_dir) -> None:
    # The stages installed the shipped weights into the mesh's model folder themselves.
    assert (Path(model_dir) / CHECKSUM_FILE).read_bytes() == (TRAINED_DIR / CHECKSUM_FILE).read_bytes()
    gen = torch.Generator().manual_seed(77)
    scenes = [shapes.random_scene(gen) for _ in range(8)]
    readings = [_picture(mesh, shapes.caption(s, set(shapes.MENTION)), seed) for seed, s in enumerate(scenes)]
    for attribute in ("colour", "background", "position"):  # chance: 1/8, 1/7, 1/9
        hits = sum(getattr(r, attribute) == getattr(s, attribute) for r, s in zip(readings, scenes))
        assert hits >= 6, (attribute, readings, scenes)


def test_a_negative_prompt_through_the_gateway_removes_its_colour(mesh) -> None:
    prompt = "a large yellow square"  # on any background
    backgrounds = [_picture(mesh, prompt, seed).background for seed in range(4)]
    redrawn = [
        _picture(mesh, prompt, seed, negative=f"a shape on {shapes.article(b)} {b} background").background
        for seed, b in enumerate(backgrounds)
    ]
    assert sum(a == b for a, b in zip(backgrounds, redrawn)) <= 1, (backgrounds, redrawn)

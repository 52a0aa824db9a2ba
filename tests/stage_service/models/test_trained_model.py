"""The shipped trained weights draw what they are told, measured on the pictures the stage runners
make: each picture is read back (training/shapes.py: background, shape colour, position, shape,
size) and compared with the attributes its caption names. Chance is 1/8 for the colour, 1/7 for
the background, 1/9 for the position, 1/3 for the shape and 1/2 for the size."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from stagemesh.core.params import InitImage, Params
from stagemesh.stage_service.models import ArRunner, DiffusionRunner, PipelineConfig, WorkItem, ensure_model_dir
from stagemesh.stage_service.models.contract import INIT_IMAGE_INPUT
from training import shapes

SIZE, STEPS = 64, 8  # the training resolution and the stage's default steps
ATTRIBUTES = ("colour", "background", "position", "shape", "size")
CHANCE = {"colour": 1 / 8, "background": 1 / 7, "position": 1 / 9, "shape": 1 / 3, "size": 1 / 2}


@pytest.fixture(scope="module")
def runners(tmp_path_factory: pytest.TempPathFactory) -> tuple[ArRunner, DiffusionRunner]:
    model = ensure_model_dir(tmp_path_factory.mktemp("trained") / "tiny", PipelineConfig.tiny())
    return ArRunner(model), DiffusionRunner(model)


@pytest.fixture(scope="module")
def scenes() -> list[shapes.Scene]:
    gen = torch.Generator().manual_seed(2024)
    return [shapes.random_scene(gen) for _ in range(32)]


def _captions(scenes: list[shapes.Scene]) -> list[str]:
    return [shapes.caption(s, set(shapes.MENTION)) for s in scenes]


def draw(
    runners: tuple[ArRunner, DiffusionRunner],
    prompts: list[str],
    seeds: list[int],
    guidance: float = 4.0,
    negatives: list[str] | None = None,
    start: tuple[list[torch.Tensor], float] | None = None,
    hidden_states_of: list[int] | None = None,
) -> list[torch.Tensor]:
    """Pictures [SIZE, SIZE, 3] in [0, 1] through both stages. `start`: starting images and the
    strength (image-to-image); `hidden_states_of[i]`: the index of the prompt whose encoding
    picture i is drawn from (cutting a picture off its own prompt)."""
    ar, diffusion = runners
    items = []
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        params = Params(prompt, SIZE, SIZE, STEPS, guidance, seed, "tensor")
        if negatives is not None:
            params = replace(params, negative_prompt=negatives[i])
        if start is not None:
            params = replace(params, strength=start[1], init_image=InitImage(SIZE, SIZE))
        items.append(WorkItem(f"r{i}", params))
    encoded = ar.run(items)
    for i, item in enumerate(items):
        item.inputs.update(encoded[i if hidden_states_of is None else hidden_states_of[i]])
        if start is not None:
            item.inputs[INIT_IMAGE_INPUT] = start[0][i]
    return [out["image"] for out in diffusion.run(items)]


def accuracy(pictures: list[torch.Tensor], scenes: list[shapes.Scene]) -> dict[str, float]:
    readings = [shapes.read_picture(p) for p in pictures]
    return {a: sum(getattr(r, a) == getattr(s, a) for r, s in zip(readings, scenes)) / len(scenes) for a in ATTRIBUTES}


def test_pictures_show_what_their_captions_name(runners, scenes) -> None:
    captions, seeds = _captions(scenes), list(range(len(scenes)))
    scores = accuracy(draw(runners, captions, seeds), scenes)
    # The kind of shape is left out: the decoder draws small shapes back as blobs (docs/MODELS.md).
    assert scores["colour"] >= 0.8 and scores["background"] >= 0.8, scores
    assert scores["position"] >= 0.7 and scores["size"] >= 0.65, scores
    # Each picture drawn from another prompt's hidden states scores at chance: the score measures
    # the conditioning, not something every picture has.
    others = seeds[1:] + seeds[:1]
    swapped = accuracy(draw(runners, captions, seeds, hidden_states_of=others), scenes)
    assert all(share <= CHANCE[attribute] + 0.2 for attribute, share in swapped.items()), swapped


def test_guidance_makes_pictures_follow_the_caption_more_closely(runners, scenes) -> None:
    """Prompts naming one attribute (a colour, or a place): the share of pictures showing it. A
    full caption is followed even unguided; one attribute alone needs guidance."""
    chosen, seeds = scenes[:24], list(range(24))
    named = {
        "colour": [f"a {s.colour} shape" for s in chosen],
        "position": [f"a shape {shapes.POSITION_PHRASES[s.position]}" for s in chosen],
    }
    shown = {
        (attribute, guidance): accuracy(draw(runners, prompts, seeds, guidance=guidance), chosen)[attribute]
        for attribute, prompts in named.items()
        for guidance in (1.0, 4.0)
    }
    gain = {attribute: shown[attribute, 4.0] - shown[attribute, 1.0] for attribute in named}
    assert min(gain.values()) > 0 and sum(gain.values()) / len(gain) >= 0.15, shown
    assert shown["colour", 4.0] >= 0.8 and shown["position", 4.0] >= 0.55, shown


def test_a_negative_prompt_removes_its_colour(runners) -> None:
    """Pictures of a red circle on a background the prompt leaves open, then the same seeds with
    a negative prompt naming the background each came out with: it changes in nearly all of
    them, and the circle mostly stays red."""
    seeds = list(range(24))
    prompts = ["a red circle"] * len(seeds)
    backgrounds = [shapes.read_picture(p).background for p in draw(runners, prompts, seeds)]
    assert len(set(backgrounds)) >= 4, backgrounds  # the prompt leaves the background open
    negatives = [f"a shape on {shapes.article(b)} {b} background" for b in backgrounds]
    redrawn = [shapes.read_picture(p) for p in draw(runners, prompts, seeds, negatives=negatives)]
    kept = [b for b, r in zip(backgrounds, redrawn) if r.background == b]
    assert len(kept) <= 0.15 * len(seeds), (backgrounds, kept)
    assert sum(r.colour == "red" for r in redrawn) >= 0.6 * len(seeds), redrawn


def test_image_to_image_at_low_strength_keeps_its_starting_picture(runners, scenes) -> None:
    """Starting from drawn pictures, with prompts naming their colours but not their place or
    size: at strength 0.25 the pictures keep the place (and stay close to the start); at 1.0
    they show the prompt's colours at a place of the model's own pick."""
    chosen = scenes[:12]
    starts = list(shapes.render(chosen, SIZE))
    prompts = [shapes.caption(s, {"colour", "shape", "background"}) for s in chosen]
    seeds = list(range(len(chosen)))
    low_pictures = draw(runners, prompts, seeds, start=(starts, 0.25))
    low = accuracy(low_pictures, chosen)
    full_pictures = draw(runners, prompts, seeds, start=(starts, 1.0))
    full = accuracy(full_pictures, chosen)
    assert low["position"] >= 0.75 and full["position"] <= 0.4, (low, full)
    assert full["colour"] >= 0.75 and full["background"] >= 0.75, full
    distance = {
        strength: sum((p - s.float() / 255).abs().mean().item() for p, s in zip(pictures, starts)) / len(starts)
        for strength, pictures in ((0.25, low_pictures), (1.0, full_pictures))
    }
    assert distance[0.25] < 0.05 and distance[0.25] < distance[1.0] / 2, distance

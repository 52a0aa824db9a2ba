"""A diffusers folder's stages report the size its own pipeline draws when a call leaves height
and width unset (FLUX.1: 1024), as the embedded model reports the size it was trained at: a
request that leaves the size unset, and the start-up warm-up, run at it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stagemesh.stage_service.models.diffusers_adapter import build_runner
from stagemesh.stage_service.models.diffusers_adapter.loading import import_diffusers
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.worker.warm_up import params_of

pytest.importorskip("transformers")
pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny

    root = tmp_path_factory.mktemp("native")
    return {family: write_tiny(root / family, family) for family in ("flux", "sd3")}


def _drawn_side(folder: Path) -> int:
    """The side of the image diffusers' own pipeline draws with height and width unset."""
    diffusers = import_diffusers()
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        prompt="a lighthouse", num_inference_steps=1, output_type="pt", generator=torch.Generator().manual_seed(0)
    ).images[0]
    assert image.shape[1] == image.shape[2]
    return int(image.shape[1])


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_a_folders_stages_report_the_size_its_pipeline_draws(folders, family):
    folder = folders[family]
    side = _drawn_side(folder)
    for kind in ("diffusion", "decode"):
        runner = build_runner(kind, folder, "cpu")
        assert runner.limits()["native_size"] == side
    settings = StageSettings(kind="diffusion", model_dir=str(folder), max_size=max(1024, side))
    assert settings.limits(runner.limits()).default_size == side
    # The warm-up runs at it: the size a request that leaves it unset gets.
    warm = params_of(settings, build_runner("diffusion", folder, "cpu"))
    assert (warm.width, warm.height) == (side, side)
    # A default_size set still wins; max_size still caps.
    assert StageSettings(kind="diffusion", default_size=64).limits(runner.limits()).default_size == 64
    capped = StageSettings(kind="diffusion", max_size=side // 2).limits(runner.limits()).default_size
    assert capped == side // 2 - (side // 2) % runner.limits()["pixel_multiple"]

"""The tiny folder of each family: shrunk configs, seeded random weights, for CPU tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from stagemesh.stage_service.models.diffusers_adapter.loading import import_diffusers
from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux_sd3 import flux_components, sd3_components


def _zimage() -> dict:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.zimage import tiny_components

    return tiny_components()


def _qwen_image() -> dict:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.qwen_image import tiny_components

    return tiny_components()


def _qwen_image_edit() -> dict:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.qwen_image_edit import tiny_components

    return tiny_components()


def _flux2_klein() -> dict:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux2 import tiny_components

    return tiny_components()


def _flux2_dev() -> dict:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux2_dev import tiny_components

    return tiny_components()


def _flux2_dev_published(folder: Path) -> None:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux2_dev import as_published

    as_published(folder)


def _wan() -> dict:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.wan import tiny_components

    return tiny_components()


def _wan_i2v() -> dict:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.wan import tiny_i2v_components

    return tiny_i2v_components()


# family name (families.py) -> (pipeline class, its tiny components)
TINY_FAMILIES: dict[str, tuple[str, Callable[[], dict]]] = {
    "flux": ("FluxPipeline", flux_components),
    "sd3": ("StableDiffusion3Pipeline", sd3_components),
    "zimage": ("ZImagePipeline", _zimage),
    "qwen-image": ("QwenImagePipeline", _qwen_image),
    "qwen-image-edit": ("QwenImageEditPipeline", _qwen_image_edit),
    "flux2-klein": ("Flux2KleinPipeline", _flux2_klein),
    "wan": ("WanPipeline", _wan),
    "wan-i2v": ("WanImageToVideoPipeline", _wan_i2v),
    "flux2": ("Flux2Pipeline", _flux2_dev),
}
# family -> what rewrites the saved folder into the published layout, where save_pretrained
# cannot write it (FLUX.2 [dev]'s PixtralProcessor, whose class needs torchvision)
PUBLISHED_LAYOUT: dict[str, Callable[[Path], None]] = {"flux2": _flux2_dev_published}


def write_pipeline(path: str | Path, pipeline_class: str, components: dict, dtype: torch.dtype = torch.float32) -> Path:
    """Save the pipeline made of `components` (cast to `dtype`) as a diffusers folder."""
    d = import_diffusers()
    # A Qwen2VLProcessor without its video processor is written apart, as a Qwen2VLProcessor.
    processor = components.pop("processor", None)
    pipe = getattr(d, pipeline_class)(**components, **({} if processor is None else {"processor": None}))
    if dtype != torch.float32:
        pipe.to(dtype=dtype)
    if processor is None:
        pipe.save_pretrained(str(path), safe_serialization=True)
        return Path(path)
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.qwen_image_edit import save_processor

    verbosity = d.utils.logging.get_verbosity()
    d.utils.logging.set_verbosity_error()  # not the notice that the processor (None) is not saved
    try:
        pipe.save_pretrained(str(path), safe_serialization=True)
    finally:
        d.utils.logging.set_verbosity(verbosity)
    save_processor(processor, Path(path))
    return Path(path)


def write_tiny(path: str | Path, family: str, seed: int = 0) -> Path:
    """A tiny pipeline folder of `family` (a name of TINY_FAMILIES) with seeded weights."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"family must be one of {sorted(TINY_FAMILIES)}, got {family!r}")
    torch.manual_seed(seed)
    pipeline_class, components = TINY_FAMILIES[family]
    folder = write_pipeline(path, pipeline_class, components())
    if family in PUBLISHED_LAYOUT:
        PUBLISHED_LAYOUT[family](folder)
    return folder

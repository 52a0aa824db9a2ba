"""Qwen-Image-Edit (QwenImageEditPipeline): Qwen-Image's transformer and VAE, conditioned on the
Qwen2.5-VL model reading the prompt together with the image to edit, through its `processor`
(vl_processor.py: the image processor and the tokenizer, no video processor)."""

from __future__ import annotations

import json
from pathlib import Path

from stagemesh.stage_service.models.diffusers_adapter.loading import import_diffusers
from stagemesh.stage_service.models.diffusers_adapter.synthetic import qwen_image
from stagemesh.stage_service.models.diffusers_adapter.synthetic.qwen_text import VISION_TOKENS, qwen_tokenizer

# The pipeline scales every input image to about 1024 x 1024 pixels before the VAE: three
# downsamplings (scale 8, as the published VAE) keep the tiny model's image tokens near 4096, and
# 4 channels at full resolution keep that encode near a second on one CPU thread.
TINY_VAE = {
    **qwen_image.TINY_VAE,
    "base_dim": 4,
    "dim_mult": [1, 1, 1, 1],
    "temperal_downsample": [False, False, False],
}
# What the vision tower sees: the image processor resizes to at most 4 x 4 patches of 14 pixels
# (2 x 2 merged tokens) in the tiny folder; the published processor's bounds (Qwen2.5-VL's) at
# full size.
TINY_PIXELS = {"min_pixels": 28 * 28, "max_pixels": 56 * 56}
PUBLISHED_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16384}
PROCESSOR = ("transformers", "Qwen2VLProcessor")


def tiny_components() -> dict:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from stagemesh.stage_service.models.diffusers_adapter.vl_processor import image_text_processor

    d = import_diffusers()
    components = qwen_image.tiny_components(VISION_TOKENS)
    components["vae"] = d.AutoencoderKLQwenImage(**TINY_VAE)
    # The processor's tokenizer is its own copy of the pipeline's, as in the published folder.
    components["processor"] = image_text_processor(
        Qwen2VLImageProcessorPil(min_pixels=TINY_PIXELS["min_pixels"], max_pixels=TINY_PIXELS["max_pixels"]),
        qwen_tokenizer(VISION_TOKENS),
    )
    return components


def save_processor(processor, folder: Path) -> None:
    """Write `processor` as the published folder lays it out (processor/: preprocessor_config.json
    and the tokenizer's files) and list it in model_index.json as a Qwen2VLProcessor."""
    where = folder / "processor"
    processor.image_processor.save_pretrained(where)
    processor.tokenizer.save_pretrained(where)
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = list(PROCESSOR)
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))

"""The model folder a stage loads: the one its settings name, else the embedded model's.

Light (no torch): a worker names its folder, and a stage checks its folder, before their heavy
imports; only the embedded model's weights, written on first use, need torch."""

from __future__ import annotations

import os
from pathlib import Path

from stagemesh.stage_service.models import diffusers_adapter, layout
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.settings import StageSettings


def default_model_dir() -> Path:
    env = os.environ.get("STAGEMESH_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "stagemesh" / "models" / "default-tiny"


def resolved_model_dir(settings: StageSettings) -> Path:
    return Path(settings.model_dir).expanduser() if settings.model_dir else default_model_dir()


def prepare_model_dir(settings: StageSettings) -> Path:
    """Generate the embedded model's weights on first use (deterministic, no download); a
    diffusers-format folder is only checked for the components this stage loads. Imports torch
    only to write the embedded model's weights: a folder already in place is checked from its
    JSON and checksums."""
    folder = resolved_model_dir(settings)
    if diffusers_adapter.is_diffusers_folder(folder) or settings.kind in diffusers_adapter.FOLDER_ONLY_KINDS:
        return diffusers_adapter.check_stage_folder(folder, settings.kind).path
    config = PipelineConfig.tiny() if settings.model_preset == "tiny" else PipelineConfig.flux_sized()
    if layout.is_current(folder, config, layout.trained_source(config)):
        return folder
    from stagemesh.stage_service.models.weights import ensure_model_dir

    return ensure_model_dir(folder, config)

"""The model folder a stage loads: the one its settings name, else the embedded model's.

Light (no torch): a worker names its folder, and a stage checks a diffusers folder, before their
heavy imports."""

from __future__ import annotations

import os
from pathlib import Path

from stagemesh.stage_service.models import diffusers_adapter
from stagemesh.stage_service.settings import StageSettings


def default_model_dir() -> Path:
    env = os.environ.get("STAGEMESH_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "stagemesh" / "models" / "default-tiny"


def resolved_model_dir(settings: StageSettings) -> Path:
    return Path(settings.model_dir).expanduser() if settings.model_dir else default_model_dir()


def needs_torch(settings: StageSettings) -> bool:
    """Whether preparing the folder imports torch: the embedded model's weights are generated
    (or checked) with it; a diffusers folder is checked from its JSON and headers."""
    folder = resolved_model_dir(settings)
    return not (diffusers_adapter.is_diffusers_folder(folder) or settings.kind in diffusers_adapter.FOLDER_ONLY_KINDS)


def prepare_model_dir(settings: StageSettings) -> Path:
    """Generate the embedded model's weights on first use (deterministic, no download); a
    diffusers-format folder is only checked for the components this stage loads."""
    folder = resolved_model_dir(settings)
    if not needs_torch(settings):
        return diffusers_adapter.check_stage_folder(folder, settings.kind).path
    from stagemesh.stage_service.models.config import PipelineConfig
    from stagemesh.stage_service.models.weights import ensure_model_dir

    config = PipelineConfig.tiny() if settings.model_preset == "tiny" else PipelineConfig.flux_sized()
    return ensure_model_dir(folder, config)

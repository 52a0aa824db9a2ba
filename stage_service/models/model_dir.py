"""The model folder a stage loads: the one its settings name, else the embedded model's."""

from __future__ import annotations

from pathlib import Path

from stagemesh.stage_service.models import diffusers_adapter
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.weights import default_model_dir, ensure_model_dir
from stagemesh.stage_service.settings import StageSettings


def resolved_model_dir(settings: StageSettings) -> Path:
    return Path(settings.model_dir).expanduser() if settings.model_dir else default_model_dir()


def prepare_model_dir(settings: StageSettings) -> Path:
    """Generate the embedded model's weights on first use (deterministic, no download); a
    diffusers-format folder is only checked for the components this stage loads."""
    folder = resolved_model_dir(settings)
    if diffusers_adapter.is_diffusers_folder(folder) or settings.kind in diffusers_adapter.FOLDER_ONLY_KINDS:
        return diffusers_adapter.check_stage_folder(folder, settings.kind).path
    config = PipelineConfig.tiny() if settings.model_preset == "tiny" else PipelineConfig.flux_sized()
    return ensure_model_dir(folder, config)

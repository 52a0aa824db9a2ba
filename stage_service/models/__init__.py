"""Embedded default pipeline: byte-level causal LM (stage 0) feeding a DiT (stage 1)."""

from stagemesh.stage_service.models.config import DiTConfig, LMConfig, PipelineConfig
from stagemesh.stage_service.models.dit import DiT, LatentDecoder, sample
from stagemesh.stage_service.models.lm import ByteTokenizer, CausalLM
from stagemesh.stage_service.models.runners import ArRunner, DiffusionRunner, WorkItem, build_runner
from stagemesh.stage_service.models.weights import default_model_dir, ensure_model_dir, load_dit, load_lm, read_config

__all__ = [
    "ArRunner",
    "ByteTokenizer",
    "CausalLM",
    "DiT",
    "DiTConfig",
    "DiffusionRunner",
    "LMConfig",
    "LatentDecoder",
    "PipelineConfig",
    "WorkItem",
    "build_runner",
    "default_model_dir",
    "ensure_model_dir",
    "load_dit",
    "load_lm",
    "read_config",
    "sample",
]

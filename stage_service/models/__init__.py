"""Embedded default pipeline: byte-level causal LM (stage 0) feeding a DiT (stage 1).

The names below load on first use: importing a module of this package (the diffusers adapter's
folder checks that `stagemesh up --model` runs, say) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagemesh.stage_service.models.config import DiTConfig, LMConfig, PipelineConfig
    from stagemesh.stage_service.models.dit import DiT, LatentDecoder, sample
    from stagemesh.stage_service.models.lm import ByteTokenizer, CausalLM
    from stagemesh.stage_service.models.model_dir import default_model_dir
    from stagemesh.stage_service.models.runners import ArRunner, DiffusionRunner, WorkItem, build_runner
    from stagemesh.stage_service.models.weights import (
        ensure_model_dir,
        load_dit,
        load_lm,
        read_config,
    )

_WHERE = {
    "DiTConfig": "config",
    "LMConfig": "config",
    "PipelineConfig": "config",
    "DiT": "dit",
    "LatentDecoder": "dit",
    "sample": "dit",
    "ByteTokenizer": "lm",
    "CausalLM": "lm",
    "ArRunner": "runners",
    "DiffusionRunner": "runners",
    "WorkItem": "runners",
    "build_runner": "runners",
    "default_model_dir": "model_dir",
    "ensure_model_dir": "weights",
    "load_dit": "weights",
    "load_lm": "weights",
    "read_config": "weights",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)

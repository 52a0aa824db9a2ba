"""Embedded default pipeline: byte-level causal LM (stage 0) feeding a DiT (stage 1)."""

from .config import DiTConfig, LMConfig, PipelineConfig
from .dit import DiT, LatentDecoder, sample
from .lm import ByteTokenizer, CausalLM
from .runners import ArRunner, DiffusionRunner, WorkItem, build_runner
from .weights import default_model_dir, ensure_model_dir, load_dit, load_lm, read_config

__all__ = [
    "ArRunner", "ByteTokenizer", "CausalLM", "DiT", "DiTConfig", "DiffusionRunner",
    "LMConfig", "LatentDecoder", "PipelineConfig", "WorkItem", "build_runner",
    "default_model_dir", "ensure_model_dir", "load_dit", "load_lm", "read_config", "sample",
]

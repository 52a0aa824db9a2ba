"""The embedded model's folder layout, and whether a folder already holds a config's weights.

Light on purpose (no torch): a stage checks that its embedded model's folder is in place before
it imports torch, so it can spawn its workers first (stage_service/entry.py); only a folder that
is absent or outdated is written, by weights.ensure_model_dir, with torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from stagemesh.stage_service.models.config import PipelineConfig

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
LM_FILE = Path("lm") / "model.safetensors"
DIT_FILE = Path("dit") / "model.safetensors"
CHECKSUM_FILE = "SHA256SUMS"
RECIPE_FILE = "training.json"
# PipelineConfig.tiny()'s weights, trained on the shapes data set; they ship in the package.
TRAINED_DIR = Path(__file__).resolve().parent / "trained"


def config_json(config: PipelineConfig) -> dict:
    return {**config.to_dict(), "format_version": FORMAT_VERSION}


def trained_source(config: PipelineConfig) -> Path | None:
    """The shipped folder whose trained weights `config` gets, or None (random weights). Its
    files are checked against its SHA256SUMS when copied."""
    return TRAINED_DIR if config == PipelineConfig.tiny() else None


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def is_current(path: Path, config: PipelineConfig, trained: Path | None) -> bool:
    """Whether `path` holds `config`'s weights as ensure_model_dir installs them; `trained`: the
    folder of shipped weights `config` gets (trained_source), None for random ones."""
    try:
        data = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    if data != config_json(config) or not (path / LM_FILE).is_file() or not (path / DIT_FILE).is_file():
        return False
    # Random weights of the trained config (an older default folder) are outdated too.
    return trained is None or _read_bytes(path / CHECKSUM_FILE) == _read_bytes(trained / CHECKSUM_FILE)

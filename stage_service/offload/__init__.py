"""Distributed layerwise offload (DLO): stream a model's blocks from host memory.

Names are imported on first use, so reading the options (offload.config) from the CLI or the
gateway does not import torch. The DiT-specific loader is `stage_service.models.dit_offload`.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Block": "plan",
    "Discovery": "plan",
    "OffloadPlan": "plan",
    "discover": "plan",
    "DloOptions": "config",
    "LayerwiseOffload": "streamer",
    "OffloadStats": "streamer",
    "MmapPlan": "checkpoint",
    "PlanRefused": "checkpoint",
    "apply_plan": "checkpoint",
    "load_or_fallback": "checkpoint",
    "plan_checkpoint": "checkpoint",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)

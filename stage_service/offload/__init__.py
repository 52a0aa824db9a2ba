"""Distributed layerwise offload (DLO): stream a model's blocks from host memory.

Names are imported on first use, so importing the package does not import torch. Its options
(DloOptions) are part of the stage's settings (`stage_service.settings`). The DiT-specific loader
is `stage_service.models.dit_offload`.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Block": "plan",
    "Discovery": "plan",
    "OffloadPlan": "plan",
    "discover": "plan",
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

"""The progress a Generate streams beside its results: what the gateway sends and a client reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageStarted:
    """A stage began work on the request."""

    stage_id: int
    kind: str


@dataclass(frozen=True)
class DenoisingStep:
    """Step `step` of `total` (from 1) of the diffusion stage, for image `index` of the request."""

    stage_id: int
    step: int
    total: int
    index: int = 0

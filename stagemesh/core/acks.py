"""A worker's answer to a sleep or wake: what a stage reports and what a client reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerAck:
    """One worker's answer to a sleep or wake. `rank` is -1 for a replica that did not answer."""

    stage_id: int
    rank: int
    ok: bool
    level: int
    freed_bytes: int = 0
    latency_ms: float = 0.0
    error: str = ""

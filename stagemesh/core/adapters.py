"""A LoRA adapter as a worker holds it: what a stage reports and what a client reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterInfo:
    """`source`: the file it was read from, relative to the stage's lora_dir; `bytes`: its
    low-rank weights; `on_device`: resident on the device (else kept in host memory)."""

    name: str
    source: str
    stage_id: int = 0
    rank: int = 0
    bytes: int = 0
    on_device: bool = True
    layers: int = 0

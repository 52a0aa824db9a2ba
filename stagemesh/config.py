"""mesh.toml: what `stagemesh up` starts. Every key is documented in docs/CONFIG.md."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from stage_service.settings import StageSettings

DEFAULT_GATEWAY_PORT = 50051


@dataclass(frozen=True)
class GatewayConfig:
    port: int = DEFAULT_GATEWAY_PORT
    max_request_bytes: int = 4 * 1024 * 1024


@dataclass(frozen=True)
class CacheConfig:
    port: int = 0
    root: str = "~/.cache/stagemesh/dlo-runtime-weights"
    max_bytes: int | None = None  # byte budget enforced after each publication; None: none


@dataclass(frozen=True)
class SupervisionConfig:
    max_restarts: int = 5  # per child, within restart_window_s
    restart_window_s: float = 300.0
    ready_timeout_s: float = 600.0
    stop_timeout_s: float = 10.0


@dataclass(frozen=True)
class MeshConfig:
    host: str = "127.0.0.1"
    log_level: str = "info"
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    stages: tuple[StageSettings, ...] = ()

    @classmethod
    def default(cls) -> "MeshConfig":
        """The embedded pipeline: the byte-level LM feeding the tiny DiT, one CPU worker each."""
        return cls(stages=(StageSettings(stage_id=0, kind="ar"), StageSettings(stage_id=1, kind="diffusion")))


def _section(cls, values: dict[str, Any], where: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    return cls(**values)


def load(path: str | Path | None) -> MeshConfig:
    if path is None:
        return MeshConfig.default()
    data = tomllib.loads(Path(path).read_text())
    mesh = dict(data.pop("mesh", {}))
    gateway = _section(GatewayConfig, data.pop("gateway", {}), "[gateway]")
    cache = _section(CacheConfig, data.pop("cache", {}), "[cache]")
    supervision = _section(SupervisionConfig, data.pop("supervision", {}), "[supervision]")
    stage_tables = data.pop("stages", None)
    if data:
        raise ValueError(f"{path}: unknown table(s) {sorted(data)}; known: mesh, gateway, cache, supervision, stages")
    config = _section(MeshConfig, mesh, "[mesh]")
    if stage_tables is None:
        stages = MeshConfig.default().stages
    else:
        stages = tuple(StageSettings.from_mapping({**t, "stage_id": i}) for i, t in enumerate(stage_tables))
    if not stages:
        raise ValueError(f"{path}: [[stages]] is empty; a mesh needs at least one stage")
    if stages[-1].kind != "diffusion":
        raise ValueError(f"{path}: the last stage must be of kind 'diffusion' (it draws the image)")
    host = config.host
    stages = tuple(replace(s, host=host) for s in stages)
    return replace(config, gateway=gateway, cache=cache, supervision=supervision, stages=stages)

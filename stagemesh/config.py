"""mesh.toml: what `stagemesh up` starts. Every key is documented in docs/CONFIG.md."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from stagemesh.core import logs, metrics, options
from stagemesh.gateway.settings import GatewaySettings
from stagemesh.stage_service.settings import StageSettings

DEFAULT_GATEWAY_PORT = 50051
PROMPT_ENCODERS = ("ar", "encoder")  # kinds whose outputs a diffusion or denoise stage draws from


@dataclass(frozen=True)
class CacheConfig:
    port: int = 0
    root: str = "~/.cache/stagemesh/dlo-runtime-weights"
    max_bytes: int | None = None  # byte budget enforced after each publication; None: none
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        metrics.check_port(self.metrics_port, "[cache] metrics_port")


@dataclass(frozen=True)
class SupervisionConfig:
    max_restarts: int = 5  # per child, within restart_window_s
    restart_window_s: float = 300.0
    ready_timeout_s: float = 600.0
    stop_timeout_s: float = 10.0


@dataclass(frozen=True)
class SecurityConfig:
    """TLS for every listener of the mesh and the token of its control calls; paths, "" = off."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""  # verifies the mesh's own channels (gateway -> stages, stages -> cache, health checks)
    token_file: str = ""

    def __post_init__(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_ca", "token_file"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"[security] {name}: must be a file path (a string), not {value!r}")
            # Absolute, so the banner's hints work from any directory.
            object.__setattr__(self, name, str(Path(value).expanduser().absolute()) if value else "")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("[security]: tls_cert and tls_key go together; give both or neither")
        if self.tls_cert and not self.tls_ca:
            raise ValueError(
                "[security] tls_ca: needed with tls_cert, so the mesh's own channels can verify "
                "its services (for a self-signed certificate: the certificate itself)"
            )

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)


@dataclass(frozen=True)
class MeshConfig:
    host: str = "127.0.0.1"
    log_level: str = "info"
    gateway: GatewaySettings = field(default_factory=lambda: GatewaySettings(port=DEFAULT_GATEWAY_PORT))
    cache: CacheConfig = field(default_factory=CacheConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    stages: tuple[StageSettings, ...] = ()

    def __post_init__(self) -> None:
        logs.check_level(self.log_level, "[mesh] log_level")

    @classmethod
    def default(cls) -> MeshConfig:
        """The embedded pipeline: the byte-level LM feeding the tiny DiT, one CPU worker each."""
        return cls(stages=(StageSettings(stage_id=0, kind="ar"), StageSettings(stage_id=1, kind="diffusion")))


def _section(cls, values: dict[str, Any], where: str):
    _check_keys(values, [f.name for f in fields(cls)], where)
    return cls(**values)


def _check_keys(values: dict[str, Any], known: list[str], where: str) -> None:
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")


def _gateway(values: dict[str, Any]) -> GatewaySettings:
    """[gateway]: the gateway's options but those `stagemesh up` sets itself (the host, the stages,
    the [security] files); a refusal names the key."""
    _check_keys(values, options.mesh_keys(GatewaySettings), "[gateway]")
    try:
        gateway = GatewaySettings(**{"port": DEFAULT_GATEWAY_PORT, **values})
    except ValueError as exc:
        raise ValueError(f"[gateway] {exc}") from None
    if gateway.api_key_file:  # absolute, as the [security] paths: the child may start elsewhere
        gateway = replace(gateway, api_key_file=str(Path(gateway.api_key_file).expanduser().absolute()))
    return gateway


def load(path: str | Path | None, model: str | Path | None = None) -> MeshConfig:
    """`model`: a diffusers-format folder (`stagemesh up --model`): without [[stages]] the mesh
    is an encoder stage and a diffusion stage over it; stage tables lacking model_dir use it."""
    if path is None and model is None:
        return MeshConfig.default()
    model = str(Path(model).expanduser().absolute()) if model is not None else None
    data = tomllib.loads(Path(path).read_text()) if path is not None else {}
    mesh = dict(data.pop("mesh", {}))
    gateway = _gateway(data.pop("gateway", {}))
    cache = _section(CacheConfig, data.pop("cache", {}), "[cache]")
    supervision = _section(SupervisionConfig, data.pop("supervision", {}), "[supervision]")
    security = _section(SecurityConfig, data.pop("security", {}), "[security]")
    stage_tables = data.pop("stages", None)
    if data:
        raise ValueError(
            f"{path}: unknown table(s) {sorted(data)}; known: mesh, gateway, cache, supervision, security, stages"
        )
    config = _section(MeshConfig, mesh, "[mesh]")
    if stage_tables is None:
        stages = model_stages(model) if model is not None else MeshConfig.default().stages
    else:
        stages = tuple(_stage(t, i, model) for i, t in enumerate(stage_tables))
    where = path if path is not None else model
    assert where is not None  # with neither, the default config was returned above
    _check_stages(stages, where)
    host = config.host
    # Every stage serves and calls with the mesh's [security] settings.
    stage_security = {k: v for k, v in vars(security).items() if v}
    stages = tuple(replace(s, host=host, **stage_security) for s in stages)
    return replace(config, gateway=gateway, cache=cache, supervision=supervision, security=security, stages=stages)


def model_stages(model: str) -> tuple[StageSettings, ...]:
    """A diffusers folder's default mesh: its text encoders, then transformer + VAE."""
    return (
        StageSettings(stage_id=0, kind="encoder", model_dir=model),
        StageSettings(stage_id=1, kind="diffusion", model_dir=model),
    )


def _stage(table: Any, stage_id: int, model: str | None) -> StageSettings:
    """One [[stages]] table; a refusal names the stage and the key."""
    where = f"[[stages]] {stage_id}"
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be a table of stage options")
    try:
        return StageSettings.from_mapping({**_with_model(table, model), "stage_id": stage_id})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _with_model(table: dict[str, Any], model: str | None) -> dict[str, Any]:
    return {**table, "model_dir": table.get("model_dir") or model} if model else table


def _check_stages(stages: tuple[StageSettings, ...], where: str | Path) -> None:
    """Stage order, and every diffusers folder holds what its stage loads, before anything
    starts: a folder without its VAE is refused here, naming the component."""
    if not stages:
        raise ValueError(f"{where}: [[stages]] is empty; a mesh needs at least one stage")
    if stages[-1].kind not in ("diffusion", "decode"):
        raise ValueError(f"{where}: the last stage must be of kind 'diffusion' or 'decode' (it draws the image)")
    for s in stages:
        before = stages[s.stage_id - 1].kind if s.stage_id else None
        if s.kind in ("diffusion", "denoise") and before not in PROMPT_ENCODERS:
            raise ValueError(
                f"{where}: stage {s.stage_id} ({s.kind}) draws from an encoded prompt, so the stage right "
                f"before it must be of kind 'ar' (the embedded model) or 'encoder' (a diffusers-format "
                f"folder); it is {'none: add one first' if before is None else repr(before)}"
            )
        if (s.kind == "decode") != (before == "denoise"):
            raise ValueError(
                f"{where}: stage {s.stage_id} ({s.kind}): a 'decode' stage comes "
                "right after a 'denoise' stage, and only there"
            )
        # Looked at without importing the adapter (it brings torch) unless a folder is involved.
        folder = Path(s.model_dir).expanduser() if s.model_dir else None
        if s.kind not in ("ar", "diffusion") or (folder and (folder / "model_index.json").is_file()):
            from stagemesh.stage_service.models import diffusers_adapter

            if folder is None:
                raise ValueError(
                    f"{where}: stage {s.stage_id} ({s.kind}) needs model_dir (a "
                    "diffusers-format folder), or `stagemesh up --model PATH`"
                )
            diffusers_adapter.check_stage_folder(folder, s.kind)

"""The embedded pipeline's weights: the trained ones shipped in the package, deterministic
random generation for every other config, and strict loading.

Layout of a model folder:
    config.json               PipelineConfig.to_dict() + {"format_version": N}
    lm/model.safetensors      CausalLM state
    dit/model.safetensors     DiT state under "dit.", LatentDecoder state under "decoder."
A folder of trained weights adds:
    SHA256SUMS                the three files' checksums (`sha256sum -c` reads it)
    training.json             the recipe that made them (training/train_embedded.py)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.dit import DiT, LatentDecoder
from stagemesh.stage_service.models.layout import (
    CHECKSUM_FILE,
    CONFIG_FILE,
    DIT_FILE,
    FORMAT_VERSION,
    LM_FILE,
    RECIPE_FILE,
    TRAINED_DIR,
    config_json,
    is_current,
)
from stagemesh.stage_service.models.lm import CausalLM
from stagemesh.stage_service.models.tp import TpGroup, shard_functions
from stagemesh.weight_store.checkpoint import CheckpointError
from stagemesh.weight_store.safetensors_writer import write_streamed

DIT_PREFIX = "dit."
DECODER_PREFIX = "decoder."
INIT_STD = 0.02
_INSTALL_ATTEMPTS = 5

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
_NORMAL_INIT = (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)


def build_lm(config: PipelineConfig, device: str | torch.device = "meta") -> CausalLM:
    """Build the LM uninitialised; on "meta" it costs no memory."""
    with torch.device(device):
        return CausalLM(config.lm).to(config.torch_dtype)


def build_dit(
    config: PipelineConfig, device: str | torch.device = "meta", tp: TpGroup | None = None
) -> tuple[DiT, LatentDecoder]:
    """`tp`: this rank's TP coordinate; the DiT's blocks then hold only its shards."""
    with torch.device(device):
        return (DiT(config.dit, tp).to(config.torch_dtype), LatentDecoder(config.dit).to(config.torch_dtype))


def read_config(path: Path) -> PipelineConfig:
    data = json.loads((Path(path) / CONFIG_FILE).read_text())
    version = data.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {version!r}, expected {FORMAT_VERSION}")
    return PipelineConfig.from_dict(data)


# ---- generation -------------------------------------------------------------------------


def _param_entries(parts: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module, str, tuple[int, ...]]]:
    """(file key, owning module, local name, shape) in the fixed module-definition order."""
    entries = []
    for prefix, model in parts:
        if list(model.buffers()):
            raise ValueError(f"{type(model).__name__} has buffers; the generator only covers parameters")
        for mod_name, module in model.named_modules():
            for p_name, param in module.named_parameters(recurse=False):
                key = f"{prefix}{mod_name}.{p_name}" if mod_name else f"{prefix}{p_name}"
                entries.append((key, module, p_name, tuple(param.shape)))
    return entries


def _init_value(key: str, module: nn.Module, p_name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """float32 CPU value of one parameter; each rule is explicit so new kinds fail loudly."""
    if isinstance(module, _NORMS):
        return torch.ones(shape) if p_name == "weight" else torch.zeros(shape)
    if p_name == "bias":
        return torch.zeros(shape)
    if (isinstance(module, _NORMAL_INIT) and p_name == "weight") or p_name == "null_cond":
        return torch.empty(shape).normal_(0.0, INIT_STD, generator=gen)
    raise ValueError(f"no init rule for parameter {key} ({type(module).__name__})")


def _write_part(file: Path, parts: list[tuple[str, nn.Module]], gen: torch.Generator, dtype: torch.dtype) -> None:
    entries = _param_entries(parts)
    specs = [(key, shape, dtype) for key, _, _, shape in entries]
    values = (_init_value(key, m, p, shape, gen).to(dtype) for key, m, p, shape in entries)
    file.parent.mkdir(parents=True, exist_ok=True)
    write_streamed(file, specs, values, metadata={"format": "pt"})


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _generate_into(target: Path, config: PipelineConfig) -> None:
    """Write a complete model folder; modules stay on "meta", values are made one at a time."""
    gen = torch.Generator(device="cpu").manual_seed(config.weight_seed)
    dtype = config.torch_dtype
    _write_part(target / LM_FILE, [("", build_lm(config))], gen, dtype)
    dit, decoder = build_dit(config)
    _write_part(target / DIT_FILE, [(DIT_PREFIX, dit), (DECODER_PREFIX, decoder)], gen, dtype)
    cfg_path = target / CONFIG_FILE
    with open(cfg_path, "w") as f:
        f.write(json.dumps(config_json(config), indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for d in (target / LM_FILE.parent, target / DIT_FILE.parent, target):
        _fsync_dir(d)


def write_model_dir(target: Path, config: PipelineConfig, lm: CausalLM, dit: DiT, decoder: LatentDecoder) -> None:
    """Write built models' weights as a model folder (what a training run produces)."""
    dtype = config.torch_dtype
    for file, parts in ((LM_FILE, {"": lm}), (DIT_FILE, {DIT_PREFIX: dit, DECODER_PREFIX: decoder})):
        state = {
            f"{prefix}{k}": v.detach().cpu().to(dtype) for prefix, m in parts.items() for k, v in m.state_dict().items()
        }
        specs = [(key, tuple(value.shape), dtype) for key, value in state.items()]
        (target / file).parent.mkdir(parents=True, exist_ok=True)
        write_streamed(target / file, specs, state.values(), metadata={"format": "pt"})
    (target / CONFIG_FILE).write_text(json.dumps(config_json(config), indent=2, sort_keys=True) + "\n")


def trained_size(model_dir: Path) -> int | None:
    """The picture side the folder's weights were trained at (its training.json), or None for
    random weights: a stage's requests default to it."""
    try:
        return int(json.loads((Path(model_dir) / RECIPE_FILE).read_text())["image_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _trained_source(config: PipelineConfig) -> Path | None:
    """layout.trained_source, through this module's TRAINED_DIR (which tests point elsewhere)."""
    return TRAINED_DIR if config == PipelineConfig.tiny() else None


def _copy_trained(target: Path, source: Path) -> None:
    """Copy a trained folder, checking every file against its SHA256SUMS."""
    sums = (source / CHECKSUM_FILE).read_text()
    for line in sums.splitlines():
        digest, name = line.split(maxsplit=1)
        data = (source / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise RuntimeError(f"{source / name}: sha256 differs from {source / CHECKSUM_FILE}; the file is damaged")
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        _write_synced(target / name, data)
    _write_synced(target / RECIPE_FILE, (source / RECIPE_FILE).read_bytes())
    # Last: a folder with its checksum file is complete.
    _write_synced(target / CHECKSUM_FILE, sums.encode())
    for d in (target / LM_FILE.parent, target / DIT_FILE.parent, target):
        _fsync_dir(d)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _install(tmp: Path, path: Path, config: PipelineConfig) -> None:
    """Rename `tmp` onto `path`; a concurrent winner with the same config is kept."""
    for _ in range(_INSTALL_ATTEMPTS):
        try:
            os.rename(tmp, path)
            _fsync_dir(path.parent)
            return
        except OSError:
            if is_current(path, config, _trained_source(config)):
                return
            if not os.path.lexists(path):
                continue
        # An outdated folder is in the way: move it aside atomically, then delete it.
        stale = path.parent / f".{path.name}.stale-{uuid.uuid4().hex}"
        try:
            os.rename(path, stale)
        except FileNotFoundError:
            continue
        _remove(stale)
    raise RuntimeError(f"could not install model folder at {path} after {_INSTALL_ATTEMPTS} attempts")


def ensure_model_dir(path: Path, config: PipelineConfig) -> Path:
    """Return `path` holding weights for `config`, installing them if absent or outdated: a copy
    of the shipped trained weights for their config (PipelineConfig.tiny()), else random ones."""
    path = Path(path).expanduser()
    trained = _trained_source(config)
    if is_current(path, config, trained):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # A sibling on the same filesystem, so the final rename is atomic.
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        tmp.mkdir()
        if trained is None:
            _generate_into(tmp, config)
        else:
            _copy_trained(tmp, trained)
        _install(tmp, path, config)
    finally:
        if os.path.lexists(tmp):
            _remove(tmp)
    return path


# ---- loading ----------------------------------------------------------------------------


def _open_checkpoint(file: Path, device: str | torch.device):
    try:
        return safe_open(str(file), framework="pt", device=str(device))
    except SafetensorError as exc:  # its message does not say which file
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


def _load_state(file: Path, parts: dict[str, nn.Module], device: str | torch.device, dtype: torch.dtype) -> None:
    """Load `file` into meta-built modules with strict key, shape and dtype checks. A TP rank
    slices each sharded tensor out of the full one (shapes are checked after slicing)."""
    expected = {
        f"{prefix}{k}": (prefix, k, tuple(v.shape))
        for prefix, module in parts.items()
        for k, v in module.state_dict().items()
    }
    shards = shard_functions(parts)
    states: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in parts}
    with _open_checkpoint(file, device) as f:
        keys = set(f.keys())
        missing, unexpected = sorted(expected.keys() - keys), sorted(keys - expected.keys())
        if missing:
            raise ValueError(f"{file}: missing key(s) {', '.join(missing[:8])}")
        if unexpected:
            raise ValueError(f"{file}: unexpected key(s) {', '.join(unexpected[:8])}")
        for key, (prefix, local, shape) in expected.items():
            tensor = f.get_tensor(key)
            if key in shards:
                tensor = shards[key](tensor)
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(f"{file}: {key} is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")
            states[prefix][local] = tensor
    for prefix, module in parts.items():
        module.load_state_dict(states[prefix], strict=True, assign=True)
        module.eval().requires_grad_(False)


def load_lm(path: Path, device: str | torch.device = "cpu") -> CausalLM:
    path = Path(path)
    config = read_config(path)
    lm = build_lm(config)
    _load_state(path / LM_FILE, {"": lm}, device, config.torch_dtype)
    return lm


def load_dit(path: Path, device: str | torch.device = "cpu", tp: TpGroup | None = None) -> tuple[DiT, LatentDecoder]:
    path = Path(path)
    config = read_config(path)
    dit, decoder = build_dit(config, tp=tp)
    _load_state(path / DIT_FILE, {DIT_PREFIX: dit, DECODER_PREFIX: decoder}, device, config.torch_dtype)
    return dit, decoder

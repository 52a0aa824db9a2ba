"""A stage's model components built on meta and filled straight on the device.

Each component (the transformer, the VAE) is made from its config with its parameters on the
meta device (buffers and plain tensor attributes computed as from_pretrained computes them), cast
to the checkpoint's dtype, so no host copy of its weights is ever made; then one parallel read
(`models.direct_load`) fills every component's tensors from every file at once, and the module
takes them as they are (`load_state_dict(assign=True)`). What from_pretrained would do beyond
that is matched: a tensor stored in another dtype is cast to the module's, as from_pretrained
casts it. A component this cannot load exactly as from_pretrained does (a class that is not a
diffusers model, one that keeps modules in float32, a checkpoint whose names or shapes differ
from the model's) goes through the ordinary loader
instead (from_pretrained on the host, then `.to(device)`), and the log says why.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stagemesh.core import logs, startup
from stagemesh.stage_service.models import direct_load
from stagemesh.stage_service.models.diffusers_adapter.folder import CheckpointFolder
from stagemesh.stage_service.models.diffusers_adapter.loading import component_class, dtype_kwarg
from stagemesh.weight_store.checkpoint import TensorRecord

log = logs.get_logger("stagemesh.diffusers")


class _Unfit(Exception):
    """The component cannot be loaded directly; the message says why."""


def _on_meta(folder: CheckpointFolder, name: str, dtype: torch.dtype) -> nn.Module:
    cls = component_class(folder, name)
    if not (hasattr(cls, "from_config") and hasattr(cls, "load_config")):
        raise _Unfit(f"{cls.__name__} is not a diffusers model class")
    if getattr(cls, "_keep_in_fp32_modules", None):
        raise _Unfit(f"{cls.__name__} keeps modules in float32, which from_pretrained decides")
    from accelerate import init_empty_weights

    # Parameters on meta (no storage); buffers and the tensors some modules keep as plain
    # attributes (Qwen-Image's rotary tables) computed as diffusers' own loader computes them,
    # in float32, then the registered ones cast with the model (as the DLO path builds it).
    with init_empty_weights(include_buffers=False):
        module = cls.from_config(cls.load_config(folder.path / name))
    nn.Module.to(module, dtype)
    module.register_to_config(_name_or_path=folder.path / name)  # as from_pretrained records it
    return module


def _matched(module: nn.Module, records: dict[str, TensorRecord]) -> None:
    state = module.state_dict(keep_vars=True)
    if state.keys() != records.keys():
        diff = sorted(state.keys() ^ records.keys())
        raise _Unfit(f"checkpoint and model names differ, e.g. {diff[:3]}")
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(records[key].shape):
            raise _Unfit(f"{key}: checkpoint {tuple(records[key].shape)}, model {tuple(tensor.shape)}")


def _fill(module: nn.Module, tensors: dict[str, torch.Tensor], device: str) -> nn.Module:
    state = module.state_dict(keep_vars=True)
    cast = {k: t if t.dtype == state[k].dtype else t.to(state[k].dtype) for k, t in tensors.items()}
    module.load_state_dict(cast, strict=True, assign=True)
    if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        raise _Unfit("a tensor stayed on meta after the load")
    # The buffers the checkpoint does not hold were computed on the host: to the device, as
    # `.to(device)` takes them after from_pretrained (the parameters are there already).
    nn.Module.to(module, device)
    return module.eval().requires_grad_(False)


def _ordinary(folder: CheckpointFolder, name: str, device: str, dtype: torch.dtype) -> nn.Module:
    cls = component_class(folder, name)
    module = cls.from_pretrained(folder.path / name, local_files_only=True, **dtype_kwarg(dtype))
    return module.to(device).eval().requires_grad_(False)


def load_components(
    folder: CheckpointFolder, names: list[str], device: str, dtype: torch.dtype, threads: int = direct_load.THREADS
) -> dict[str, nn.Module]:
    """Each of `names` on `device`, filled by one parallel read of all their files."""
    built: dict[str, nn.Module] = {}
    records: dict[str, TensorRecord] = {}
    unfit: dict[str, str] = {}
    with startup.phase("build on meta", components=",".join(names)):
        for name in names:
            try:
                module = _on_meta(folder, name, dtype)
                mine = direct_load.records_of(folder.weight_files(name))
                _matched(module, mine)
            except _Unfit as exc:
                unfit[name] = str(exc)
                continue
            built[name] = module
            records.update({f"{name}/{key}": r for key, r in mine.items()})
    out: dict[str, nn.Module] = {}
    if built:
        nbytes = sum(r.nbytes for r in records.values())
        with startup.phase("direct read", components=",".join(built), bytes=nbytes, threads=threads):
            tensors = direct_load.read_tensors((), device, threads=threads, records=records)
        for name, module in built.items():
            mine_tensors: dict[str, Any] = {
                key.split("/", 1)[1]: t for key, t in tensors.items() if key.startswith(name + "/")
            }
            try:
                out[name] = _fill(module, mine_tensors, device)
            except _Unfit as exc:
                unfit[name] = str(exc)
        del tensors
    for name, why in unfit.items():
        log.info("component loaded by from_pretrained, not directly", component=name, reason=why)
        with startup.phase("from_pretrained", component=name):
            out[name] = _ordinary(folder, name, device, dtype)
    return {name: out[name] for name in names}

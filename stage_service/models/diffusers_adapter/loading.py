"""Loading a diffusers folder's components offline: the pipeline shell with only what a stage
needs, the transformer resident or under DLO, and the weight files sleep level 2 reloads."""

from __future__ import annotations

import os

# Before diffusers / transformers / huggingface_hub are imported: a stage never reaches the
# network, whatever the environment says.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Services log JSON lines on stderr: no progress bars, no import-time notices from transformers.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stagemesh.core import logs
from stagemesh.stage_service.models.contract import WeightFile
from stagemesh.stage_service.models.diffusers_adapter.families import Family
from stagemesh.stage_service.models.diffusers_adapter.folder import CheckpointFolder
from stagemesh.stage_service.settings import DloOptions
from stagemesh.weight_store.checkpoint import read_index

log = logs.get_logger("stagemesh.diffusers")


def import_diffusers():
    try:
        diffusers = importlib.import_module("diffusers")
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        raise RuntimeError(
            f"serving a diffusers-format folder needs the optional extra: pip install 'stagemesh[diffusers]' ({exc})"
        ) from None
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    return diffusers


def dtype_kwarg(dtype: torch.dtype) -> dict:
    """Newer diffusers name it `dtype` (and warn about `torch_dtype`); older know only
    `torch_dtype`."""
    try:
        helpers = importlib.import_module("diffusers.utils.deprecation_utils")
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype} if hasattr(helpers, "_resolve_dtype") else {"torch_dtype": dtype}


def checkpoint_dtype(folder: CheckpointFolder) -> torch.dtype:
    """The floating dtype holding most bytes of the transformer (else the VAE) weights: the
    checkpoint is served as stored, and the DLO mmap plan needs the model in that dtype."""
    name = "transformer" if (folder.path / "transformer").is_dir() else "vae"
    sizes: dict[torch.dtype, int] = {}
    for file in folder.weight_files(name):
        for record in read_index(file).values():
            if record.dtype.is_floating_point:
                sizes[record.dtype] = sizes.get(record.dtype, 0) + record.nbytes
    return max(sizes, key=sizes.__getitem__) if sizes else torch.float32


def load_pipeline(folder: CheckpointFolder, keep: list[str], dtype: torch.dtype, **given):
    """The folder's pipeline class with only `keep` loaded from disk and `given` passed in;
    every other listed component is None."""
    diffusers = import_diffusers()
    cls = getattr(diffusers, folder.pipeline_class)
    absent = {n: None for n in folder.components if n not in keep and n not in given}
    pipe = cls.from_pretrained(folder.path, local_files_only=True, **dtype_kwarg(dtype), **absent, **given)
    pipe.set_progress_bar_config(disable=True)  # the denoising loop's bar; progress goes by RPC
    return pipe


def component_class(folder: CheckpointFolder, name: str):
    import_diffusers()
    library, class_name = folder.components[name]
    return getattr(importlib.import_module(library), class_name)


def import_classes(folder: CheckpointFolder, kind: str) -> None:
    """Import diffusers, transformers, the pipeline class and the classes of the components
    `kind` loads; a class the installed libraries lack is left for the load to report."""
    diffusers = import_diffusers()
    for name in folder.needed_by(kind):
        try:
            component_class(folder, name)
        except (AttributeError, ImportError, KeyError):
            pass
    getattr(diffusers, folder.pipeline_class, None)


def load_transformer(
    folder: CheckpointFolder,
    family: Family,
    device: str,
    dtype: torch.dtype,
    opts: DloOptions,
    name: str = "transformer",
):
    """(transformer, DLO engine or None) of component `name`. Under DLO the blocks stay on the
    host: checkpoint views when the mmap plan is proven, else the ordinary loader's copies."""
    cls = component_class(folder, name)
    where = folder.path / name

    def ordinary():
        return cls.from_pretrained(where, local_files_only=True, **dtype_kwarg(dtype))

    if not opts.enable_dlo:
        return ordinary().to(device).eval().requires_grad_(False), None
    from stagemesh.stage_service.offload import quant
    from stagemesh.stage_service.offload.checkpoint import load_or_fallback
    from stagemesh.stage_service.offload.streamer import LayerwiseOffload

    # Parameters on meta (no storage), buffers and the tensors some modules keep as plain
    # attributes (Qwen-Image's rotary tables) computed on the host as diffusers' loader does.
    model = _on_meta_as_loaded(cls, where, dtype)
    loaded: dict[str, Any] = {}
    if opts.dlo_checkpoint_mmap:
        reason = load_or_fallback(
            folder.weight_files(name), {"": model}, lambda: loaded.setdefault("model", ordinary())
        )
    else:
        loaded["model"], reason = ordinary(), "dlo_checkpoint_mmap is off"
    if reason is not None:
        model = loaded["model"]
    model.eval().requires_grad_(False)
    engine = LayerwiseOffload(
        model,
        device,
        plan=family.offload_plan(),
        resident_layers=opts.dlo_resident_layers,
        use_allgather=False,
        keep_source=reason is None,
        stream_dtype=quant.stream_dtype(opts.dlo_stream_dtype),
    )
    return model, engine


def _on_meta_as_loaded(cls, where, dtype: torch.dtype) -> nn.Module:
    """The model on meta in the dtypes from_pretrained gives it. A class that keeps modules in
    float32 is built as from_pretrained builds it, with `dtype` the default (buffers made in an
    explicit dtype, Wan's float32 rotary tables, stay so; it casts nothing after), and those
    modules' tensors in float32. A checkpoint storing them in float32 (as diffusers saves them) is
    then mapped; one storing them narrower takes the ordinary loader, which widens them (the mmap
    plan refuses the dtype mismatch). Any other class: built in float32 and cast with torch's own
    `to` (diffusers' warns)."""
    from accelerate import init_empty_weights

    keeps = bool(getattr(cls, "_keep_in_fp32_modules", None))
    saved = torch.get_default_dtype()
    if keeps:
        torch.set_default_dtype(dtype)
    try:
        with init_empty_weights(include_buffers=False):
            model = cls.from_config(cls.load_config(where))
    finally:
        torch.set_default_dtype(saved)
    if keeps:
        keep_in_float32(model, dtype)
    else:
        nn.Module.to(model, dtype)
    return model


def keep_in_float32(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Cast the floating state tensors of the class's `_keep_in_fp32_modules` (Wan's
    time_embedder, scale_shift_table, norm1-3, ...) to float32 in place, by diffusers' own rule
    (a module name equal to one component of the tensor's dotted name); from_pretrained loads
    them so whatever `dtype` the rest takes. Returns the names cast."""
    keep = getattr(type(model), "_keep_in_fp32_modules", None) or []
    keep = [keep] if isinstance(keep, str) else list(keep)
    if not keep or dtype == torch.float32:
        return []
    cast = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point() or tensor.dtype == torch.float32:
            continue
        if not any(part in keep for part in name.split(".")):
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(tensor.detach().to(torch.float32), requires_grad=False)
        else:
            module._buffers[leaf] = tensor.to(torch.float32)
        cast.append(name)
    return cast


def refuse_unsupported(opts: DloOptions) -> None:
    """Options the diffusers path does not implement fail at start, saying what to change."""
    if opts.tensor_parallel_size > 1:
        raise ValueError(
            "tensor_parallel_size > 1 is not available for diffusers-format folders; set tensor_parallel_size = 1"
        )
    if opts.allgather_active:
        raise ValueError(
            "dp_size > 1 with DLO AllGather is not available for diffusers-format "
            "folders; set dlo_use_allgather = false (or dp_size = 1)"
        )
    if opts.dlo_enable_runtime_cache:
        raise ValueError(
            "dlo_enable_runtime_cache is not available for diffusers-format "
            "folders (DLO maps the checkpoint directly); drop it"
        )


@dataclass(frozen=True)
class ShardFile(WeightFile):
    """One safetensors file of a component: manages exactly the tensors stored in it, so a
    sharded checkpoint gives one entry per file and tied tensors are reloaded once."""

    keys: frozenset = frozenset()

    def manages(self, key: str) -> bool:
        return key in self.keys and super().manages(key)


def weight_files(
    folder: CheckpointFolder, name: str, module: nn.Module, skip: tuple[str, ...] = ()
) -> list[WeightFile]:
    """What sleep level 2 reloads `module` (component `name`) from."""
    files = folder.weight_files(name)
    state = module.state_dict(keep_vars=True)
    out: list[WeightFile] = []
    covered: set[int] = set()
    for file in files:
        keys = frozenset(read_index(file)) & state.keys()
        covered |= {id(state[k]) for k in keys}
        out.append(ShardFile(file, {"": module}, skip, keys))
    # A tensor found in no file (a tied copy is found through its twin) would stay on the device.
    stray = sorted(k for k, t in state.items() if id(t) not in covered and not k.startswith(skip))
    if stray:
        log.warning(
            "tensors not in the checkpoint stay on the device while asleep",
            component=name,
            tensors=stray[:5],
            count=len(stray),
        )
    return out

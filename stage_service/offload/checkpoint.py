"""Direct-checkpoint mmap plan: bind safetensors bytes to a model without a private copy.

`plan_checkpoint` proves, without touching the model, that the files cover exactly the model's
state (names, shapes, dtypes, element alignment, TP1, no loader callbacks that could rewrite
tensors, no aliased state, every non-persistent buffer has a value to restore). Only then does
`apply_plan` move the modules to meta, bind views of a private read-only file mapping (pages
come from the shared OS page cache), restore the non-persistent buffers and run the post-load
hooks. `load_or_fallback` runs the ordinary loader instead, and logs why, whenever the proof fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from stagemesh.core import logs
from stagemesh.weight_store.checkpoint import (
    CheckpointError,
    TensorRecord,
    map_file,
    read_index,
    record_view,
)

log = logs.get_logger("stagemesh.offload.checkpoint")


class PlanRefused(Exception):
    """The checkpoint cannot be proven to map onto the model; the message says why."""


@dataclass
class MmapPlan:
    parts: dict[str, nn.Module]
    records: dict[str, TensorRecord]
    owners: dict[str, tuple[str, str]]  # checkpoint name -> (part prefix, name in the part)
    mappings: dict[Path, torch.Tensor] = field(default_factory=dict)


def _read_records(files: list[Path]) -> dict[str, TensorRecord]:
    records: dict[str, TensorRecord] = {}
    for file in files:
        try:
            # validate: safetensors itself must accept the file, as the ordinary loader reads it.
            found = read_index(file, validate=True)
        except CheckpointError as exc:
            raise PlanRefused(str(exc)) from None
        except OSError as exc:
            raise PlanRefused(f"{file}: unreadable safetensors header ({exc})") from None
        dup = sorted(records.keys() & found.keys())
        if dup:
            raise PlanRefused(f"tensor {dup[0]!r} appears in more than one file")
        records.update(found)
    return records


def _default_load(module: nn.Module) -> bool:
    return type(module)._load_from_state_dict is nn.Module._load_from_state_dict


def _expected(parts: dict[str, nn.Module]) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, str]]]:
    """Checkpoint name -> the model tensor it must fill, and -> (prefix, local name)."""
    expected: dict[str, torch.Tensor] = {}
    owners: dict[str, tuple[str, str]] = {}
    for prefix, module in parts.items():
        for sub_name, sub in module.named_modules():
            if not _default_load(sub) or sub._load_state_dict_pre_hooks:
                raise PlanRefused(
                    f"{prefix}{sub_name or type(sub).__name__} transforms tensors while loading (a load callback)"
                )
        state = module.state_dict(keep_vars=True)
        seen: dict[int, str] = {}
        for name, t in state.items():
            if id(t) in seen:
                raise PlanRefused(f"{prefix}{name} aliases {prefix}{seen[id(t)]} (tied tensors)")
            seen[id(t)] = name
            if f"{prefix}{name}" in expected:
                raise PlanRefused(f"{prefix}{name} is claimed by two parts")
            expected[f"{prefix}{name}"] = t
            owners[f"{prefix}{name}"] = (prefix, name)
    return expected, owners


def _non_persistent(module: nn.Module) -> dict[str, torch.Tensor]:
    persistent = set(module.state_dict(keep_vars=True))
    return {name: b for name, b in module.named_buffers() if name not in persistent}


def _check(records: dict[str, TensorRecord], expected: dict[str, torch.Tensor]) -> None:
    missing = sorted(expected.keys() - records.keys())
    if missing:
        raise PlanRefused(f"missing tensor(s) {', '.join(missing[:5])}")
    extra = sorted(records.keys() - expected.keys())
    if extra:
        raise PlanRefused(f"tensor(s) no planned module owns: {', '.join(extra[:5])}")
    for name, t in expected.items():
        r = records[name]
        if r.shape != tuple(t.shape):
            raise PlanRefused(f"{name}: shape {r.shape} in the checkpoint, {tuple(t.shape)} in the model")
        if r.dtype != t.dtype:
            raise PlanRefused(f"{name}: dtype {r.dtype} in the checkpoint, {t.dtype} in the model")
        if r.file_offset % r.dtype.itemsize:
            raise PlanRefused(f"{name}: offset {r.file_offset} is not aligned to its dtype")


def plan_checkpoint(files: list[Path], parts: dict[str, nn.Module], tp_size: int = 1) -> MmapPlan:
    """Prove the plan or raise PlanRefused. `parts`: checkpoint prefix -> module."""
    if tp_size != 1:
        raise PlanRefused(f"tensor_parallel_size {tp_size} > 1: the mmap plan covers TP1 only")
    files = [Path(f) for f in files]
    for prefix, module in parts.items():
        for name, b in _non_persistent(module).items():
            if b.is_meta:
                raise PlanRefused(f"non-persistent buffer {prefix}{name} has no value to restore")
    records = _read_records(files)
    expected, owners = _expected(parts)
    _check(records, expected)
    return MmapPlan(dict(parts), records, owners)


def _view(plan: MmapPlan, name: str) -> torch.Tensor:
    r = plan.records[name]
    if r.path not in plan.mappings:
        plan.mappings[r.path] = map_file(r.path)
    return record_view(plan.mappings[r.path], r)


def apply_plan(plan: MmapPlan) -> None:
    """Bind the mapped tensors. The model is touched only here, after the proof."""
    for prefix, module in plan.parts.items():
        saved = _non_persistent(module)
        module.to("meta")
        state = {local: _view(plan, name) for name, (owner, local) in plan.owners.items() if owner == prefix}
        module.load_state_dict(state, strict=True, assign=True)  # runs post-load hooks
        for qualified, buf in saved.items():
            owner, _, leaf = qualified.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = buf
        post = getattr(module, "post_load_weights", None)
        if callable(post):
            post()


def load_or_fallback(
    files: list[Path], parts: dict[str, nn.Module], fallback: Callable[[], None], tp_size: int = 1
) -> str | None:
    """Map the checkpoint into `parts`, or call `fallback` (the ordinary loader) untouched.
    Returns None when mapped, else the reason it was refused."""
    try:
        plan = plan_checkpoint(files, parts, tp_size)
    except PlanRefused as exc:
        log.warning("dlo mmap plan refused; using the ordinary loader", reason=str(exc))
        fallback()
        return str(exc)
    apply_plan(plan)
    log.info("dlo mmap plan applied", files=[str(f) for f in files], tensors=len(plan.records))
    return None

"""Which submodules of a model are streamed block by block.

A model declares an `OffloadPlan` (class attribute `_offload_plan`, or `offload_plan`). Without
one, discovery tries well-known attribute names, then the largest ModuleList whose children all
have the same type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from torch import nn

from stagemesh.core import logs

log = logs.get_logger("stagemesh.offload")

# Attribute names of block lists in common DiT and transformer code, in execution order.
FALLBACK_ATTRS: tuple[str, ...] = (
    "blocks",
    "transformer_blocks",
    "single_transformer_blocks",
    "layers",
)
PLAN_ATTRS = ("_offload_plan", "offload_plan")


def _freeze_submodules(value) -> tuple[str, ...]:
    # {"context_encoder": "layers"} is accepted as shorthand for ("context_encoder.layers",).
    if isinstance(value, Mapping):
        return tuple(f"{k}.{v}" if v else str(k) for k, v in value.items())
    return tuple(value)


@dataclass(frozen=True)
class OffloadPlan:
    """`block_attrs`: submodule path ("" = the model itself) -> names of its block ModuleLists, in
    execution order. `offload_submodules`: further dotted paths streamed too (a ModuleList
    contributes its children, anything else is one block). `resident_paths`: dotted paths (from
    the model root) of block lists whose leading blocks may stay on the device."""

    block_attrs: Mapping[str, tuple[str, ...]]
    offload_submodules: tuple[str, ...] = ()
    resident_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        frozen = {str(k): (v,) if isinstance(v, str) else tuple(v) for k, v in dict(self.block_attrs).items()}
        object.__setattr__(self, "block_attrs", MappingProxyType(frozen))
        object.__setattr__(self, "offload_submodules", _freeze_submodules(self.offload_submodules))
        object.__setattr__(self, "resident_paths", tuple(self.resident_paths))

    def list_paths(self) -> list[str]:
        """Dotted paths of every streamed list or submodule, in declared order."""
        paths = [_join(owner, attr) for owner, attrs in self.block_attrs.items() for attr in attrs]
        return paths + list(self.offload_submodules)


def _join(owner: str, attr: str) -> str:
    return f"{owner}.{attr}" if owner else attr


@dataclass(frozen=True)
class Block:
    """One streamed unit: its dotted path, the module, and the list path it came from."""

    path: str
    module: nn.Module
    group: str = field(compare=False)


@dataclass(frozen=True)
class Discovery:
    blocks: tuple[Block, ...]
    source: str  # "plan", "attributes" or "heuristic"
    plan: OffloadPlan | None = None

    def resident_candidates(self) -> list[Block]:
        """Blocks in declared order whose list the plan marks as eligible to stay resident."""
        eligible = set(self.plan.resident_paths) if self.plan is not None else set()
        return [b for b in self.blocks if b.group in eligible]


def declared_plan(model: nn.Module) -> OffloadPlan | None:
    for name in PLAN_ATTRS:
        plan = getattr(model, name, None)
        if isinstance(plan, OffloadPlan):
            return plan
    return None


def _expand(model: nn.Module, path: str) -> list[Block]:
    try:
        target = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"offload plan names {path!r}, which {type(model).__name__} does not have") from None
    if isinstance(target, nn.ModuleList):
        return [Block(_join(path, str(i)), child, path) for i, child in enumerate(target)]
    return [Block(path, target, path)]


def _same_type_list(value) -> bool:
    return isinstance(value, nn.ModuleList) and len(value) > 0 and len({type(m) for m in value}) == 1


def _from_attributes(model: nn.Module) -> list[str]:
    return [a for a in FALLBACK_ATTRS if _same_type_list(getattr(model, a, None))]


def _heuristic(model: nn.Module) -> list[str]:
    """The ModuleList of same-type blocks holding the most parameters (ties: most children)."""
    best, best_key = None, None
    for name, module in model.named_modules():
        if not name or not _same_type_list(module):
            continue
        numel = sum(p.numel() for p in module.parameters())
        key = (numel, len(module))
        if numel and (best_key is None or key > best_key):
            best, best_key = name, key
    return [best] if best is not None else []


def _check_disjoint(blocks: list[Block]) -> None:
    paths = [b.path for b in blocks]
    for i, a in enumerate(paths):
        for b in paths[i + 1 :]:
            if a == b or a.startswith(b + ".") or b.startswith(a + "."):
                raise ValueError(f"offload blocks overlap: {a!r} and {b!r}")


def discover(model: nn.Module, plan: OffloadPlan | None = None) -> Discovery:
    """The blocks to stream: the given or declared plan, else attribute names, else heuristic."""
    plan = plan if plan is not None else declared_plan(model)
    if plan is not None:
        source, paths = "plan", plan.list_paths()
    else:
        source, paths = "attributes", _from_attributes(model)
        if not paths:
            source, paths = "heuristic", _heuristic(model)
    blocks = [b for p in paths for b in _expand(model, p)]
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no offloadable blocks found; declare an OffloadPlan on the model")
    _check_disjoint(blocks)
    return Discovery(tuple(blocks), source, plan)


def pick_resident(found: Discovery, n: int, world: int) -> list[Block]:
    """The leading eligible blocks that stay on the device (none with AllGather: `world` > 1)."""
    if n < 0:
        raise ValueError(f"resident_layers must be >= 0, got {n}")
    if n == 0:
        return []
    if world > 1:
        raise ValueError(
            "resident layers need no-AllGather: every rank must rebuild the same "
            "blocks; use dlo_use_allgather = false or resident_layers = 0"
        )
    candidates = found.resident_candidates()
    if not candidates:
        log.warning(
            "dlo resident layers ignored: the model declares no resident_paths in its "
            "OffloadPlan, so every block streams",
            requested=n,
        )
        return []
    if n > len(candidates):
        log.warning("dlo resident layers capped", requested=n, eligible=len(candidates))
    return candidates[:n]

"""Splitting one image's work across the ranks of a stage: sequence parallel (sp_size ranks each
hold a slice of the image tokens; attention exchanges them, see sequence_parallel.py) and CFG
parallel (the conditional and the unconditional pass on two ranks, their predictions exchanged
once per step). The two compose: 2 x sp_size ranks, one sequence group per pass.

Global rank = cfg_rank * sp_size + sp_rank: ranks 0..sp_size-1 run the conditional pass, the
next sp_size the unconditional one. Rank 0 is the output rank. Every rank runs the whole sampler
on identical latents, so no rank waits for another outside the collectives of a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stagemesh.stage_service.offload.collective import gather_into


@dataclass(frozen=True)
class Axis:
    """A rank's place along one way of splitting; `group` is None only when size is 1."""

    size: int
    rank: int
    group: Any = None  # a torch.distributed ProcessGroup

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad rank coordinate: rank {self.rank} of {self.size}")

    @property
    def split(self) -> bool:
        return self.size > 1


ALONE = Axis(1, 0)


@dataclass(frozen=True)
class ImageParallel:
    """A rank's coordinate in the stage's image-parallel group."""

    sp: Axis = ALONE
    cfg: Axis = ALONE

    @property
    def world(self) -> int:
        return self.sp.size * self.cfg.size

    @property
    def output(self) -> bool:
        """The rank whose result the stage returns (rank 0)."""
        return self.sp.rank == 0 and self.cfg.rank == 0


def form_axes(sp_size: int, cfg_size: int, rank: int, world_group=None) -> ImageParallel:
    """This rank's coordinate in a joined group of sp_size * cfg_size ranks. Both axes split:
    one sequence group per pass and one pair group per sequence slice, created by every rank in
    the same order (torch.distributed's rule for new_group)."""
    world = sp_size * cfg_size
    if world_group is None:
        world_group = dist.group.WORLD
    if dist.get_world_size(world_group) != world:
        raise ValueError(
            f"sp_size {sp_size} x cfg {cfg_size} needs a group of {world} ranks, got {dist.get_world_size(world_group)}"
        )
    sp_rank, cfg_rank = rank % sp_size, rank // sp_size
    if sp_size == 1 or cfg_size == 1:
        sp = Axis(sp_size, sp_rank, world_group if sp_size > 1 else None)
        cfg = Axis(cfg_size, cfg_rank, world_group if cfg_size > 1 else None)
        return ImageParallel(sp, cfg)
    sp_groups = [dist.new_group([c * sp_size + s for s in range(sp_size)]) for c in range(cfg_size)]
    cfg_groups = [dist.new_group([c * sp_size + s for c in range(cfg_size)]) for s in range(sp_size)]
    return ImageParallel(Axis(sp_size, sp_rank, sp_groups[cfg_rank]), Axis(cfg_size, cfg_rank, cfg_groups[sp_rank]))


def gather_along(local: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Every rank's `local` (equal shapes) concatenated along `dim`, in rank order."""
    if not axis.split:
        return local
    moved = local.movedim(dim, 0).contiguous()
    out = moved.new_empty((axis.size * moved.shape[0], *moved.shape[1:]))
    gather_into(out, moved, axis.group)
    return out.movedim(0, dim)


def exchange_passes(mine: torch.Tensor, cfg: Axis) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank 0's prediction, rank 1's prediction) of a CFG pair, on both ranks."""
    both = gather_along(mine[None], cfg, 0)
    return both[0], both[1]

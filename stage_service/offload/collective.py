"""The one weight collective of DLO: rebuild a block from every rank's equal-sized shard."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from stagemesh.stage_service import platform

# Backends found to lack the single-tensor gather; they use the list form from then on. Every
# rank of a group shares the backend, so all of them take the same path in the same order.
_LIST_ONLY: set[str] = set()


def group_shape(group) -> tuple[int, int]:
    """(world size, rank) of `group`; (1, 0) for no group."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _single(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, shard, group=group)


def gather_into(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    """Fill `out` (world * shard bytes) with every rank's `shard`, in rank order."""
    world = dist.get_world_size(group)
    if out.numel() != world * shard.numel():
        raise ValueError(f"gather output holds {out.numel()} elements, expected {world} x {shard.numel()}")
    backend = str(dist.get_backend(group))
    if backend not in _LIST_ONLY:
        try:
            _single(out, shard, group)
            return
        except (NotImplementedError, AttributeError):
            _LIST_ONLY.add(backend)
        except RuntimeError as exc:
            if "not supported" not in str(exc).lower() and "unsupported" not in str(exc).lower():
                raise
            _LIST_ONLY.add(backend)
    # Chunks of `out` are contiguous views, so the list form writes in place: no concatenation.
    dist.all_gather(list(out.chunk(world)), shard, group=group)


def join_group(address: str, rank: int, world_size: int, device: str, timeout_s: float):
    """Join the stage's DP group (NCCL on CUDA, gloo otherwise) and return it. Every rank
    blocks here until all `world_size` ranks have arrived at `address`."""
    kwargs: dict[str, Any] = {}
    backend = "gloo"
    if platform.is_cuda(device):
        backend = "nccl"
        torch.cuda.set_device(device)
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(
        backend, init_method=address, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **kwargs
    )
    return dist.group.WORLD


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

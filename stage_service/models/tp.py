"""Tensor parallelism for the embedded DiT: column- and row-parallel linears over a
torch.distributed group (gloo on the CPU, NCCL on CUDA).

Column-parallel layers keep a slice of the output features (attention heads, MLP hidden units);
row-parallel layers keep the matching slice of the input features and sum their partial
products with one all-reduce. Parameter names stay those of nn.Linear, so the checkpoint keys
are the same at every TP size: each rank slices its shard out of the full tensor when loading.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TpGroup:
    """A rank's place in the stage's TP group; `group` None only when size is 1."""

    size: int
    rank: int
    group: object = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad TP coordinate: rank {self.rank} of {self.size}")


def split(total: int, tp: TpGroup, what: str) -> int:
    if total % tp.size:
        raise ValueError(f"{what} = {total} is not divisible by tensor_parallel_size {tp.size}")
    return total // tp.size


class ColumnParallelLinear(nn.Linear):
    """Keeps output features [rank*n, (rank+1)*n) of each of `chunks` equal output chunks
    (chunks = 2 for a fused key/value projection, so each rank gets its heads' k and v)."""

    def __init__(self, in_features: int, out_features: int, tp: TpGroup, chunks: int = 1) -> None:
        super().__init__(in_features, split(out_features, tp, "out_features"))
        self.tp, self.chunks, self.full_out = tp, chunks, out_features

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        # Weight [out, in] and bias [out] both split along dim 0.
        per = self.full_out // self.chunks // self.tp.size
        parts = full.chunk(self.chunks, dim=0)
        return torch.cat([p[self.tp.rank * per : (self.tp.rank + 1) * per] for p in parts]).clone()


class RowParallelLinear(nn.Linear):
    """Keeps input features [rank*n, (rank+1)*n); the bias is whole and added once, after the
    partial products are summed."""

    def __init__(self, in_features: int, out_features: int, tp: TpGroup) -> None:
        super().__init__(split(in_features, tp, "in_features"), out_features)
        self.tp = tp

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name == "bias":
            return full.clone()
        n = self.in_features
        return full[:, self.tp.rank * n : (self.tp.rank + 1) * n].contiguous().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = F.linear(x, self.weight)
        # Summed in float32: partial sums rounded to bf16 first would add a rounding per rank.
        total = part.float()
        dist.all_reduce(total, group=self.tp.group)
        return (total + self.bias.float()).to(part.dtype)


def column(in_features: int, out_features: int, tp: TpGroup | None, chunks: int = 1) -> nn.Linear:
    """A plain nn.Linear at TP1, so a single rank computes exactly what it always did."""
    if tp is None or tp.size == 1:
        return nn.Linear(in_features, out_features)
    return ColumnParallelLinear(in_features, out_features, tp, chunks)


def row(in_features: int, out_features: int, tp: TpGroup | None) -> nn.Linear:
    if tp is None or tp.size == 1:
        return nn.Linear(in_features, out_features)
    return RowParallelLinear(in_features, out_features, tp)


def shard_functions(parts: dict[str, nn.Module]) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Checkpoint key -> function(full tensor) -> this rank's shard, for every sharded tensor."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for prefix, model in parts.items():
        for mod_name, module in model.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            for p_name, _ in module.named_parameters(recurse=False):
                key = f"{prefix}{mod_name}.{p_name}"
                out[key] = functools.partial(module.shard, p_name)
    return out

"""Byte layout of one block: every parameter and buffer packed into one flat uint8 buffer.

Offsets are aligned to 256 bytes: the most alignment PyTorch's GPU matmul heuristics consider
(device allocations are 512-aligned), and a multiple of the CPU allocator's 64. So a block in a
slot gets the same kernels as the same block as ordinary tensors (identical results), and any
dtype view is legal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 256


def align_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Entry:
    module: nn.Module
    name: str
    is_param: bool
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def current(self) -> torch.Tensor:
        store = self.module._parameters if self.is_param else self.module._buffers
        tensor = store[self.name]
        assert tensor is not None, "layouts hold only registered tensors"
        return tensor


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` as a flat uint8 tensor (a view when `t` is contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class BlockLayout:
    """Where each tensor of a block lives in its packed buffer. Tensors shared inside the block
    are stored once; `nbytes` is the exact packed size."""

    def __init__(self, block: nn.Module, path: str = "") -> None:
        self.path = path
        self.module = block
        self.entries: list[Entry] = []
        seen: dict[int, int] = {}
        offset = 0
        for _, module in block.named_modules(remove_duplicate=False):
            for is_param, store in ((True, module._parameters), (False, module._buffers)):
                for name, t in store.items():
                    if t is None:
                        continue
                    key = id(t)
                    if key not in seen:
                        offset = align_up(offset)
                        seen[key] = offset
                        offset += t.numel() * t.element_size()
                    self.entries.append(
                        Entry(module, name, is_param, seen[key], t.numel() * t.element_size(), tuple(t.shape), t.dtype)
                    )
        self.nbytes = offset
        self._unique = sorted({e.offset: e for e in self.entries}.values(), key=lambda e: e.offset)

    def tensor_ids(self) -> set[int]:
        return {id(e.current()) for e in self.entries}

    def payload_bytes(self) -> int:
        """Bytes of the tensors themselves, without alignment padding."""
        return sum(e.nbytes for e in self._unique)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Typed views, one per entry, into a uint8 buffer holding this layout."""
        return [flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries]

    def bind(self, views: list[torch.Tensor]) -> None:
        """Point every parameter and buffer of the block at `views` (no copy)."""
        for e, v in zip(self.entries, views):
            if e.is_param:
                param = e.module._parameters[e.name]
                assert param is not None, "layouts hold only registered tensors"
                param.data = v
            else:
                e.module._buffers[e.name] = v

    def sources(self) -> list[tuple[Entry, torch.Tensor]]:
        """(entry, current bytes) for each distinct stored tensor, in offset order."""
        return [(e, byte_view(e.current())) for e in self._unique]

    def pack_range(
        self, sources: list[tuple[Entry, torch.Tensor]], lo: int, hi: int, out: torch.Tensor, non_blocking: bool = False
    ) -> None:
        """Copy bytes [lo, hi) of the packed block into `out` (uint8, hi - lo long); padding is
        zeroed so every rank holds identical bytes."""
        cursor = lo
        for e, src in sources:
            start, end = max(lo, e.offset), min(hi, e.offset + e.nbytes)
            if start >= end:
                continue
            if start > cursor:
                out[cursor - lo : start - lo].zero_()
            out[start - lo : end - lo].copy_(src[start - e.offset : end - e.offset], non_blocking=non_blocking)
            cursor = end
        if cursor < hi:
            out[cursor - lo : hi - lo].zero_()

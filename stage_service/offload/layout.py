"""Byte layout of one block: every parameter and buffer packed into one flat uint8 buffer.

Offsets are aligned to 256 bytes: the most alignment PyTorch's GPU matmul heuristics consider
(device allocations are 512-aligned), and a multiple of the CPU allocator's 64. So a block in a
slot gets the same kernels as the same block as ordinary tensors (identical results), and any
dtype view is legal. Tensors picked by `tail` are placed after all the others, so the rest forms
one contiguous head (8-bit streaming copies the head as it is and rebuilds the tail).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

ALIGN = 256


def align_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


# (module, local name, tensor) -> whether the tensor goes to the tail of the layout
TailRule = Callable[[nn.Module, str, torch.Tensor], bool]


class Span(Protocol):
    """Where a stored tensor's bytes lie in a packed block."""

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class StreamLayout(Protocol):
    """A block as the host stores it and the link carries it: a BlockLayout itself, or its 8-bit
    form (quant.QuantizedLayout)."""

    path: str
    module: nn.Module
    nbytes: int

    def needs_values(self) -> bool: ...

    def sources(self) -> Sequence[tuple[Span, torch.Tensor]]: ...

    def pack_range(
        self,
        sources: Sequence[tuple[Span, torch.Tensor]],
        lo: int,
        hi: int,
        out: torch.Tensor,
        non_blocking: bool = False,
    ) -> None: ...

    def bind_packed(self, host: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class Entry:
    module: nn.Module
    name: str
    is_param: bool
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    qualname: str = ""  # the tensor's name from the model root (state_dict style)

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
    are stored once; `nbytes` is the exact packed size. With `tail`, the tensors it picks (all of
    their entries must agree) come after the others: `head_nbytes` ends the rest, and `tail`
    lists the picked tensors' entries in offset order."""

    def __init__(self, block: nn.Module, path: str = "", tail: TailRule | None = None) -> None:
        self.path = path
        self.module = block
        found: list[tuple[nn.Module, str, bool, torch.Tensor, str]] = []
        picked: dict[int, bool] = {}
        for mod_name, module in block.named_modules(remove_duplicate=False):
            for is_param, store in ((True, module._parameters), (False, module._buffers)):
                for name, t in store.items():
                    if t is None:
                        continue
                    qualname = ".".join(p for p in (path, mod_name, name) if p)
                    found.append((module, name, is_param, t, qualname))
                    wanted = tail is not None and tail(module, name, t)
                    picked[id(t)] = picked.get(id(t), True) and wanted
        offsets: dict[int, int] = {}
        offset = 0
        for in_tail in (False, True):
            if in_tail:
                self.head_nbytes = offset
            for _, _, _, t, _ in found:
                if id(t) not in offsets and picked[id(t)] == in_tail:
                    offset = align_up(offset)
                    offsets[id(t)] = offset
                    offset += t.numel() * t.element_size()
        self.entries = [
            Entry(m, n, is_param, offsets[id(t)], t.numel() * t.element_size(), tuple(t.shape), t.dtype, q)
            for m, n, is_param, t, q in found
        ]
        self.nbytes = offset
        self._unique = sorted({e.offset: e for e in self.entries}.values(), key=lambda e: e.offset)
        self.tail = [e for e in self._unique if e.offset >= self.head_nbytes and picked[id(e.current())]]

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

    def sources(self, upto: int | None = None) -> list[tuple[Entry, torch.Tensor]]:
        """(entry, current bytes) for each distinct stored tensor, in offset order; with `upto`,
        only those that start before that offset (the head: the tail may be placeholders)."""
        unique = self._unique if upto is None else [e for e in self._unique if e.offset < upto]
        return [(e, byte_view(e.current())) for e in unique]

    def needs_values(self) -> bool:
        """Whether some tensor of the block is still on "meta" (built, not yet given values)."""
        return any(e.current().is_meta for e in self.entries)

    def pack_range(
        self,
        sources: Sequence[tuple[Span, torch.Tensor]],
        lo: int,
        hi: int,
        out: torch.Tensor,
        non_blocking: bool = False,
    ) -> None:
        pack_range(sources, lo, hi, out, non_blocking)

    def bind_packed(self, host: torch.Tensor) -> None:
        """Point the block at its packed host copy (dropping its private tensors)."""
        self.bind(self.views(host))


def pack_range(
    sources: Sequence[tuple[Span, torch.Tensor]], lo: int, hi: int, out: torch.Tensor, non_blocking: bool = False
) -> None:
    """Copy bytes [lo, hi) of a packed block, given as (span, bytes) in offset order, into `out`
    (uint8, hi - lo long); padding is zeroed so every rank holds identical bytes."""
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

"""Where streamed blocks live on the host, and how one block's bytes are handed to the H2D copy.

- `PackedStore`: each block packed once into its own host buffer of exact size (pinned for a
  CUDA target); the block's tensors are re-pointed there, so the private copies are released.
- `ShardStore` (AllGather): this rank keeps bytes [rank*S, (rank+1)*S) of every block; the
  last shard is zero-padded so all shards have the same size S.
- `StagedStore`: the block tensors stay where they are (a checkpoint mapping); each transfer packs
  the block into one of two bounded pinned staging buffers.
- `LockedMappingStore`: the block tensors stay in a file mapping whose pages are page-locked in
  place, so each transfer is DMA straight from the page cache (which every engine mapping the
  same runtime-cache entry shares): no staging copy, no private copy.

Every store fills a device buffer with block i's bytes on the current (copy) stream: `fill`. A
store holds blocks in their stream layout (layout.StreamLayout): the block's own bytes, or its
8-bit form (quant.py), which the engine rebuilds in the slot after the copy.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from stagemesh.core import logs
from stagemesh.stage_service import platform
from stagemesh.stage_service.offload.layout import StreamLayout, align_up

InitBlock = Callable[[nn.Module], None]

log = logs.get_logger("stagemesh.offload")


def _materialize(layout: StreamLayout, init_block: InitBlock | None) -> None:
    # A block built on "meta" gets real host values one block at a time, so a model larger than
    # host memory twice over can still be packed.
    if layout.needs_values():
        if init_block is None:
            raise ValueError(
                f"block {layout.path!r} is on the meta device and no init_block was given to materialise it"
            )
        init_block(layout.module)


def shard_nbytes(nbytes: int, world: int) -> int:
    return align_up(-(-nbytes // world))


class PackedStore:
    def __init__(
        self, layouts: list[StreamLayout], device: str | torch.device, init_block: InitBlock | None = None
    ) -> None:
        self.layouts = layouts
        self.buffers: list[platform.HostBuffer] = []
        for layout in layouts:
            _materialize(layout, init_block)
            buf = platform.HostBuffer(layout.nbytes, device)
            layout.pack_range(layout.sources(), 0, layout.nbytes, buf.tensor)
            # Re-pointing the block drops its last reference to the private copy.
            layout.bind_packed(buf.tensor)
            self.buffers.append(buf)

    @property
    def host_bytes(self) -> int:
        return sum(b.tensor.numel() for b in self.buffers)

    def block_nbytes(self, i: int) -> int:
        """Device bytes block i takes once its copy (and gather) is complete."""
        return self.layouts[i].nbytes

    def h2d_nbytes(self, i: int) -> int:
        return self.layouts[i].nbytes

    def fill(self, i: int, target: torch.Tensor, stream: platform.Stream) -> int:
        """Copy block i's host bytes (this rank's shard, for a ShardStore) into the front of
        `target` on `stream`; returns how many bytes that is."""
        src = self.buffers[i].tensor
        target[: src.numel()].copy_(src, non_blocking=True)
        return src.numel()

    def close(self) -> None:
        for b in self.buffers:
            b.close()


class ShardStore(PackedStore):
    def __init__(
        self,
        layouts: list[StreamLayout],
        device: str | torch.device,
        rank: int,
        world: int,
        init_block: InitBlock | None = None,
    ) -> None:
        self.layouts = layouts
        self.world = world
        self.shard = [shard_nbytes(layout.nbytes, world) for layout in layouts]
        self.buffers = []
        for layout, size in zip(layouts, self.shard):
            _materialize(layout, init_block)
            buf = platform.HostBuffer(size, device)
            lo = min(rank * size, layout.nbytes)
            hi = min(lo + size, layout.nbytes)
            layout.pack_range(layout.sources(), lo, hi, buf.tensor[: hi - lo])
            buf.tensor[hi - lo :].zero_()
            self.buffers.append(buf)

    def block_nbytes(self, i: int) -> int:
        return self.shard[i] * self.world

    def h2d_nbytes(self, i: int) -> int:
        return self.shard[i]


class StagedStore(PackedStore):
    def __init__(self, layouts: list[StreamLayout], device: str | torch.device) -> None:
        self.layouts = layouts
        # Byte views keep the mapped storage alive once the parameters point at device slots.
        self.sources = [layout.sources() for layout in layouts]
        size = max((layout.nbytes for layout in layouts), default=0)
        self.buffers = [platform.HostBuffer(size, device) for _ in range(2)]
        self._done = [platform.DeviceEvent(device) for _ in range(2)]
        self._next = 0

    def fill(self, i: int, target: torch.Tensor, stream: platform.Stream) -> int:
        k, self._next = self._next, self._next ^ 1
        # The H2D copy that last read this staging buffer must be finished before we refill it.
        self._done[k].synchronize()
        n = self.layouts[i].nbytes
        out = self.buffers[k].tensor[:n]
        self.layouts[i].pack_range(self.sources[i], 0, n, out)
        target[:n].copy_(out, non_blocking=True)
        self._done[k].record(stream)
        return n

    def close(self) -> None:
        for e in self._done:
            e.synchronize()
        super().close()


class LockedMappingStore(PackedStore):
    """Blocks copied straight from their (page-locked) mapping into the device slot, tensor by
    tensor. Built by `locked_mapping_store` only when every mapping could be locked."""

    def __init__(self, layouts: list[StreamLayout], sources: list, unlock: list) -> None:
        self.layouts = layouts
        self.sources = sources  # byte views: they keep the mappings alive while locked
        self.buffers = []
        self._unlock = unlock
        # Unlocked before the mappings can go away, also when close() is never called.
        self._finalizer = weakref.finalize(self, _run_all, unlock)

    def fill(self, i: int, target: torch.Tensor, stream: platform.Stream) -> int:
        n = self.layouts[i].nbytes
        self.layouts[i].pack_range(self.sources[i], 0, n, target[:n], non_blocking=True)
        return n

    def close(self) -> None:
        self._finalizer()


def _run_all(functions: list) -> None:
    for f in functions:
        f()


def locked_mapping_store(layouts: list[StreamLayout], device: str | torch.device) -> LockedMappingStore | None:
    """Lock every storage the blocks' tensors live in (once each); None, with nothing left
    locked, when that is not possible (a CPU target, or the driver refuses)."""
    sources = [layout.sources() for layout in layouts]
    storages = {src.untyped_storage().data_ptr(): src for block in sources for _, src in block}
    started = time.perf_counter()
    unlock: list[Callable[[], object]] = []
    for src in storages.values():
        undo = platform.lock_pages_in_place(src, device)
        if undo is None:
            _run_all(unlock)
            if platform.is_cuda(device):  # a CPU target has nothing to lock: no news
                log.warning(
                    "dlo mapping not page-locked (the driver refused); blocks are "
                    "staged through pinned buffers instead",
                    mappings=len(storages),
                )
            return None
        unlock.append(undo)
    log.info(
        "dlo mapping page-locked in place",
        mappings=len(storages),
        bytes=sum(s.untyped_storage().nbytes() for s in storages.values()),
        seconds=round(time.perf_counter() - started, 3),
    )
    return LockedMappingStore(layouts, sources, unlock)

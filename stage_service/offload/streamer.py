"""Layerwise offload of any nn.Module through a fixed two-slot device buffer.

Streamed blocks keep their bytes on the host (see host.py). Two device slots, each sized by the
largest block, take turns: while block N computes on the compute stream, block N+1 is copied
host-to-device on a copy stream (and, with AllGather, rebuilt from every rank's shard on a
second stream; with 8-bit streaming, rebuilt in the model's dtype there from its 8-bit form) into
the other slot. Events order the streams:

    ready[s]  recorded after slot s is filled      -> the compute stream waits before using it
    free[s]   recorded after the block in slot s ran -> the copy stream waits before refilling it
                                                        (8-bit: the rebuild into the slot waits)

With 8-bit streaming the copies land in a ring of STAGING_BUFFERS buffers instead, each reused
once the rebuild that read it has run (consumed[k]), so the link runs ahead of the rebuilds and
the compute; the rebuilds run on a high-priority stream, so the compute's kernels do not hold
them back (measured: docs/perf-notes/dlo.md).

A forward pre-hook points the block's parameters at typed views into its slot. Which block runs
next is learned from the order the blocks actually ran in (first guess: declared order, wrapping
around), so the first block of the next denoising step is fetched while the last one computes,
and a mispredicted block is simply loaded on demand. Everything that is not a streamed block
stays resident on the device. On the CPU events and streams are no-ops and the copies are plain
memcpy, so results are bit-identical to the resident model (8-bit streaming aside: its weights are
rounded once, at load).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from stagemesh.core import logs
from stagemesh.stage_service import platform
from stagemesh.stage_service.offload import quant
from stagemesh.stage_service.offload.collective import gather_into, group_shape
from stagemesh.stage_service.offload.host import InitBlock, PackedStore, ShardStore, StagedStore, locked_mapping_store
from stagemesh.stage_service.offload.layout import BlockLayout, StreamLayout
from stagemesh.stage_service.offload.placement import check_no_sharing, move_rest
from stagemesh.stage_service.offload.plan import OffloadPlan, discover, pick_resident

log = logs.get_logger("stagemesh.offload")

STAGING_BUFFERS = 3  # 8-bit copy buffers (one GPU): the link may run this many blocks ahead of the rebuilds
REBUILD_PRIORITY = -1  # CUDA stream priority of the 8-bit rebuilds (lower is first; 0 the default)


@dataclass(frozen=True)
class OffloadStats:
    streamed_blocks: int
    resident_blocks: int
    block_bytes: int  # packed bytes of every streamed block (one iteration's weights)
    payload_bytes: int  # the same without alignment padding
    host_bytes: int  # host buffers this engine owns (pinned for a CUDA target)
    slot_bytes: int  # device bytes of the two slots (and shard buffers)
    h2d_bytes_per_iteration: int  # bytes this rank moves over the host link per iteration
    world: int
    host_mode: str  # "packed", "sharded", "staged" or "locked"
    discovery: str
    stream_dtype: str = ""  # "float8_e4m3fn" or "int8" when Linear weights stream in 8 bits; "": as stored


def _check_stream_dtype(dtype: torch.dtype | None, quantized) -> torch.dtype | None:
    quant.check_stream_dtype(dtype)
    if quantized is not None and dtype is None:
        raise ValueError("quantized weights were given but stream_dtype is None (as stored)")
    return dtype


class LayerwiseOffload:
    """Attach layerwise offload to `model` (in place). `group` with `use_allgather`: a
    torch.distributed group whose ranks each keep 1/world of every block. `keep_source`: blocks
    stay in their current host tensors (a checkpoint mapping or a runtime-cache entry): on a CUDA
    device the mapping is page-locked in place and copied from directly (its pages stay the
    shared page cache); where the driver refuses, each transfer is staged through pinned buffers.
    `init_block`: materialises a block built on "meta" into host memory, one block at a time.
    `stream_dtype` float8_e4m3fn or int8: streamed blocks' Linear weights are kept and copied in
    8 bits and rebuilt in the slot (quant.py); `quantized` gives them already quantised (by qualified
    name, e.g. from a runtime-cache entry), else they are quantised here, once."""

    def __init__(
        self,
        model: nn.Module,
        device: str | torch.device,
        *,
        plan: OffloadPlan | None = None,
        resident_layers: int = 0,
        group=None,
        use_allgather: bool = True,
        keep_source: bool = False,
        init_block: InitBlock | None = None,
        background_staging: bool | None = None,
        stream_dtype: torch.dtype | None = None,
        quantized: Mapping[str, quant.Quantized] | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.discovery = discover(model, plan)
        self.group = group if use_allgather else None
        self.world, self.rank = group_shape(self.group)
        resident = pick_resident(self.discovery, resident_layers, self.world)
        resident_paths = {b.path for b in resident}
        self.streamed = [b for b in self.discovery.blocks if b.path not in resident_paths]
        self.resident = resident
        self.stream_dtype = _check_stream_dtype(stream_dtype, quantized)
        tail = quant.quantizable if self.streams_quantized else None
        self.layouts = [BlockLayout(b.module, b.path, tail=tail) for b in self.streamed]
        roots = {b.path for b in self.streamed}
        check_no_sharing(model, self.layouts, roots)
        self.streams = self._stream_layouts(quantized)
        move_rest(model, roots, self.device)
        self._init_state()
        # 8-bit from unquantised tensors (a checkpoint mapping): quantised into packed buffers,
        # not streamed from where they are.
        in_place = keep_source and (not self.streams_quantized or quantized is not None)
        with torch.inference_mode(False):
            self.store = self._make_store(in_place, init_block)
            self._make_slots()
        if background_staging is None:
            background_staging = isinstance(self.store, StagedStore) and platform.is_cuda(device)
        # Packing from a mapping is host work; a thread keeps it off the compute thread.
        self._stager = (
            cf.ThreadPoolExecutor(1, thread_name_prefix="dlo-stage")
            if background_staging and isinstance(self.store, StagedStore)
            else None
        )
        self._hooks = self._install_hooks()
        if self.layouts:
            self._load(0, 0)

    # set-up -------------------------------------------------------------------------------
    @property
    def streams_quantized(self) -> bool:
        return self.stream_dtype is not None

    def _stream_layouts(self, quantized: Mapping[str, quant.Quantized] | None) -> list[StreamLayout]:
        dtype = self.stream_dtype
        if dtype is None:
            return list(self.layouts)
        quant.refuse_float8_blocks(self.layouts, dtype)
        if not any(layout.tail for layout in self.layouts):
            log.warning("dlo 8-bit streaming has nothing to quantise: the streamed blocks hold no Linear weights")
        # Quantised on the target device when it is a GPU: a FLUX-size model in seconds.
        return [quant.QuantizedLayout(layout, self.device, quantized, dtype) for layout in self.layouts]

    def _make_store(self, keep_source: bool, init_block: InitBlock | None) -> PackedStore:
        if self.world > 1:
            self.host_mode = "sharded"
            return ShardStore(self.streams, self.device, self.rank, self.world, init_block)
        locked = locked_mapping_store(self.streams, self.device) if keep_source else None
        if locked is not None:
            self.host_mode = "locked"
            return locked
        if keep_source:
            self.host_mode = "staged"
            return StagedStore(self.streams, self.device)
        self.host_mode = "packed"
        return PackedStore(self.streams, self.device, init_block)

    def _make_slots(self) -> None:
        self._alloc_slots()
        if self.host_mode == "sharded" or self.streams_quantized:
            # Drop the full private copies (or the mapping): the host keeps only this rank's
            # shards, or the 8-bit form.
            for i, (layout, views) in enumerate(zip(self.layouts, self._views)):
                layout.bind(views[0])
                self._bound[i] = 0

    def _alloc_slots(self) -> None:
        n = len(self.layouts)
        assembled = max((self.store.block_nbytes(i) for i in range(n)), default=0)
        size = max((layout.nbytes for layout in self.layouts), default=0) if self.streams_quantized else assembled
        self._slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        # 8-bit: the copied (and gathered) block lands here and is rebuilt into the slot.
        self._packed = (
            [torch.empty(assembled, dtype=torch.uint8, device=self.device) for _ in range(self._staging)]
            if self.streams_quantized
            else self._slots
        )
        self._stage = 0  # the staging buffer the next 8-bit copy lands in
        shard = max((self.store.h2d_nbytes(i) for i in range(n)), default=0)
        self._shards = (
            [torch.empty(shard, dtype=torch.uint8, device=self.device) for _ in range(2)] if self.world > 1 else []
        )
        for t in self._buffers():
            # Freed slots must not be reused before the side streams' last writes land.
            platform.record_stream(t, self._copy)
            if self._comm is not None:
                platform.record_stream(t, self._comm)
        self._views = [[layout.views(slot) for slot in self._slots] for layout in self.layouts]

    def _init_state(self) -> None:
        n = len(self.layouts)
        dev = self.device
        self._copy = platform.Stream(dev)
        # The second stage of a fill (gather, 8-bit rebuild) runs beside the next block's copy.
        priority = REBUILD_PRIORITY if self.streams_quantized else 0
        self._comm = platform.Stream(dev, priority) if self.world > 1 or self.streams_quantized else None
        # A ring of staging buffers where a copy's target is not the slot or the shard buffer.
        self._staging = max(2, STAGING_BUFFERS) if self.streams_quantized and self.world == 1 else 2
        self._ready = [platform.DeviceEvent(dev) for _ in range(2)]
        self._free = [platform.DeviceEvent(dev) for _ in range(2)]
        self._copied = [platform.DeviceEvent(dev) for _ in range(self._staging)]
        self._consumed = [platform.DeviceEvent(dev) for _ in range(self._staging)]
        self._owner: list[int | None] = [None, None]
        self._bound: list[int | None] = [None] * n  # slot each block's tensors point at
        self._pending: list[cf.Future | None] = [None, None]
        self._next = [(i + 1) % n for i in range(n)]
        self._current = 1
        self._prev: int | None = None
        self._closed = False
        self._released = False
        self.transfers = 0
        self.h2d_bytes = 0  # copied host -> device so far (the stage's offload metric)

    def _install_hooks(self) -> list:
        hooks = []
        for i, block in enumerate(self.streamed):
            hooks.append(block.module.register_forward_pre_hook(functools.partial(self._before, i)))
            # always_call: a block that raised must still release its slot.
            hooks.append(block.module.register_forward_hook(functools.partial(self._after, i), always_call=True))
        return hooks

    # runtime ------------------------------------------------------------------------------
    def _before(self, i: int, module: nn.Module, args) -> None:
        if self._closed or self._released:
            state = "closed" if self._closed else "released (asleep)"
            raise RuntimeError(f"layerwise offload is {state}; this block has no weights")
        compute = platform.current_stream(self.device)
        if self._prev is not None and self._prev != i:
            self._next[self._prev] = i
        self._prev = i
        s = self._slot_of(i)
        if s is None:
            s = 1 - self._current
            self._load(i, s)
        pending, self._pending[s] = self._pending[s], None
        if pending is not None:
            pending.result()
        compute.wait_event(self._ready[s])
        if self._bound[i] != s:
            self.layouts[i].bind(self._views[i][s])
            self._bound[i] = s
        self._current = s
        nxt = self._next[i]
        if self._slot_of(nxt) is None:
            self._load(nxt, 1 - s)

    def _after(self, i: int, module: nn.Module, args, output) -> None:
        s = self._slot_of(i)
        if s is not None:
            self._free[s].record(platform.current_stream(self.device))

    def _slot_of(self, i: int) -> int | None:
        return 0 if self._owner[0] == i else 1 if self._owner[1] == i else None

    def _load(self, i: int, s: int) -> None:
        self._owner[s] = i
        self.transfers += 1
        if self._stager is None:
            self._issue(i, s)
        else:
            self._pending[s] = self._stager.submit(self._issue, i, s)

    def _issue(self, i: int, s: int) -> None:
        """Fill slot s with block i; every rank calls this in the same order (collectives).
        8-bit on one GPU: the copy lands in the next staging buffer, free once the rebuild that
        last read it ran; only the rebuild waits for the block in slot s to have run."""
        if not self.streams_quantized:
            self._copy.wait_event(self._free[s])
        if self.world > 1:
            # The last gather from slot s's shard buffer read what this copy overwrites (a
            # prefetched block that never ran has no later free event to wait for).
            k, target = s, self._shards[s]
            self._copy.wait_event(self._ready[s])
        elif self.streams_quantized:
            k, self._stage = self._stage, (self._stage + 1) % self._staging
            target = self._packed[k]
            self._copy.wait_event(self._consumed[k])
        else:
            k, target = s, self._slots[s]
        with self._copy.active():
            sent = self.store.fill(i, target, self._copy)
            self.h2d_bytes += sent
            self._copied[k].record(self._copy)
        if self._comm is None:
            self._ready[s].record(self._copy)
            return
        self._comm.wait_event(self._copied[k])
        with self._comm.active():
            if self.world > 1:
                assembled = self._packed[s][: self.store.block_nbytes(i)]
                gather_into(assembled, self._shards[s][:sent], self.group)
            else:
                assembled = self._packed[k][: self.store.block_nbytes(i)]
            if self.streams_quantized:
                layout = self.streams[i]
                assert isinstance(layout, quant.QuantizedLayout)  # every stream layout when quantised
                self._comm.wait_event(self._free[s])
                layout.expand(assembled, self._slots[s])
            self._ready[s].record(self._comm)
            self._consumed[k].record(self._comm)

    # life cycle ---------------------------------------------------------------------------
    def stats(self) -> OffloadStats:
        n = len(self.layouts)
        return OffloadStats(
            streamed_blocks=n,
            resident_blocks=len(self.resident),
            block_bytes=sum(layout.nbytes for layout in self.layouts),
            payload_bytes=sum(layout.payload_bytes() for layout in self.layouts),
            host_bytes=self.store.host_bytes,
            slot_bytes=self._device_bytes(),
            h2d_bytes_per_iteration=sum(self.store.h2d_nbytes(i) for i in range(n)),
            world=self.world,
            host_mode=self.host_mode,
            discovery=self.discovery.source,
            stream_dtype=quant.dtype_name(self.stream_dtype),
        )

    def synchronize(self) -> None:
        """Wait for every transfer in flight (before freeing or reusing memory)."""
        for k, f in enumerate(self._pending):
            if f is not None:
                f.result()
                self._pending[k] = None
        self._copy.synchronize()
        if self._comm is not None:
            self._comm.synchronize()

    def _buffers(self) -> list[torch.Tensor]:
        """Every device buffer of the engine, each once."""
        return self._slots + (self._packed if self._packed is not self._slots else []) + self._shards

    def _device_bytes(self) -> int:
        return sum(t.numel() for t in self._buffers())

    def release_device(self) -> int:
        """Free the device slots (sleep). Host copies stay; streamed blocks point at empty
        tensors until restore_device(). Returns the slot bytes released."""
        if self._closed or self._released:
            return 0
        self.synchronize()
        freed = self._device_bytes()
        for layout in self.layouts:
            # Views into a slot would keep it alive.
            layout.bind([torch.empty(0, dtype=e.dtype, device=self.device) for e in layout.entries])
        self._slots, self._packed, self._shards, self._views = [], [], [], []
        self._owner, self._pending = [None, None], [None, None]
        self._bound = [None] * len(self.layouts)
        self._current, self._prev = 1, None
        self._released = True
        return freed

    def restore_device(self) -> int:
        """Re-create the slots after release_device() and prefetch the first block, as at start
        (every AllGather rank calls it, so the collectives stay in step). Returns slot bytes."""
        if self._closed or not self._released:
            return 0
        with torch.inference_mode(False):
            self._alloc_slots()
        self._released = False
        if self.layouts:
            self._load(0, 0)
        return self._device_bytes()

    def close(self) -> None:
        """Remove the hooks; a packed model is pointed back at its host copy."""
        if self._closed:
            return
        for h in self._hooks:
            h.remove()
        self.synchronize()
        if self._stager is not None:
            self._stager.shutdown(wait=True)
        if self.host_mode == "packed" and not self.streams_quantized:
            for layout, buf in zip(self.layouts, self.store.buffers):
                layout.bind(layout.views(buf.tensor))
        self._closed = True

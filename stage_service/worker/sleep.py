"""Giving a worker's device memory back and taking it again.

Level 1 copies every weight into one exact-size host buffer (`HostCopy`: an anonymous mapping
faulted in and page-locked piece by piece, kept across cycles) and frees the device copies;
level 2 frees them without a copy. Waking allocates one device buffer for all weights and fills
it from the host buffer (level 1) or straight from the page-locked checkpoint mapping (level 2,
`reload.MappedFill`). The Parameter and buffer objects stay the same throughout: only their
storage changes, so nothing that holds a module sees a difference.

When the host buffer is prepared is `host_buffer` (the stage's `sleep_host_buffer`):
"first_sleep" (by the first level-1 sleep, which then pays for faulting in and locking it),
"at_start" (before the worker reports ready) or "background" (on threads once the model is
loaded, while the worker serves). Prepared ahead, the buffer holds host memory of the weights'
size for the worker's life (`warm_dma` can also send a DMA through each piece while preparing it:
host_pages.WARM_DMA). With "at_start" the worker also calls `compact()`: the weights go through
the buffer once and come back as one device allocation, as after any wake, so the first sleep
releases one allocation instead of the loader's hundreds and copies in whole pieces (measured in
docs/perf-notes/sleep-wake.md). That costs a sleep's and a wake's copies at start and no memory
beyond what sleep already holds.

The two modes that prepare ahead also hold the checkpoint: the first level-2 sleep maps it and
starts locking the pieces the weights lie in on threads (while the stage sleeps), and the
mapping and its locks are kept across cycles, so every later level-2 wake is pure DMA from
page-locked page cache (which the kernel then cannot evict: the weights' size again). Each wake
first checks that every file is still the version mapped (`checkpoint.file_version`); one that
was replaced or rewritten is mapped and locked afresh. "first_sleep" maps and locks per wake
and lets go right after.

The controller manages what a runner's `weight_files()` names; a runner may leave tensors out
(`WeightFile.skip`: those a layerwise offload engine streams from its own host copies) and hand
over `DeviceHolder`s for other device memory it owns (the engine's slots): they are released
inside the measured window of a sleep and restored on wake.
"""

from __future__ import annotations

import gc
import mmap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stagemesh.stage_service import platform
from stagemesh.stage_service.models.contract import DeviceHolder, WeightFile
from stagemesh.stage_service.settings import SLEEP_HOST_BUFFERS
from stagemesh.stage_service.worker.checkpoint_source import CheckpointSource, Wanted
from stagemesh.stage_service.worker.host_pages import PIECE_BYTES, WARM_DMA, WARM_DMAS, HostCopy, Ranges, WarmDma

_ALIGN = 64  # bytes: every tensor starts on a 64-byte boundary of the flat buffers


@dataclass
class _Entry:
    path: Path  # the checkpoint file a level-2 wake reloads it from
    key: str  # checkpoint key (within `path`), or "" for a non-persistent buffer
    tensor: torch.Tensor  # the live Parameter or buffer object
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SleepResult:
    level: int
    freed_bytes: int
    latency_ms: float


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class SleepController:
    """`host_buffer`: when the level-1 host buffer is prepared (SLEEP_HOST_BUFFERS), and whether
    the checkpoint is held locked across level-2 cycles (every mode but "first_sleep");
    `piece_bytes`: the unit in which host memory is locked and copied (a multiple of the page
    size); `warm_dma`: how memory locked ahead of need is warmed (host_pages.WARM_DMAS)."""

    def __init__(
        self,
        files: list[WeightFile],
        device: str,
        host_buffer: str = "first_sleep",
        piece_bytes: int = PIECE_BYTES,
        warm_dma: str = WARM_DMA,
    ):
        if host_buffer not in SLEEP_HOST_BUFFERS:
            raise ValueError(f"host_buffer = {host_buffer!r}; allowed: {', '.join(SLEEP_HOST_BUFFERS)}")
        if piece_bytes <= 0 or piece_bytes % mmap.PAGESIZE:
            raise ValueError(f"piece_bytes = {piece_bytes}: must be a positive multiple of {mmap.PAGESIZE}")
        if warm_dma not in WARM_DMAS:
            raise ValueError(f"warm_dma = {warm_dma!r}; allowed: {', '.join(WARM_DMAS)}")
        self.device = torch.device(device)
        self.files = files
        self.host_buffer = host_buffer
        self.level = 0
        self._piece_bytes = piece_bytes
        self._warm_dma = warm_dma
        self._entries = list(self._collect())
        self._total = _aligned(sum(_aligned(e.nbytes) for e in self._entries))
        self._host: HostCopy | None = None  # level-1 copy, kept for reuse across cycles
        self._device_flat: torch.Tensor | None = None  # set once the weights live in one buffer
        self._holders: list[DeviceHolder] = []  # released by the last sleep, restored on wake
        self.last_sleep_phases: dict[str, float] = {}  # seconds of the last sleep's copy and release
        wanted = [Wanted(e.path, e.key, tuple(e.shape), e.dtype, e.offset, e.nbytes) for e in self._entries if e.key]
        self._checkpoint = CheckpointSource(
            files,
            wanted,
            self.device,
            piece_bytes,
            held=host_buffer != "first_sleep",  # the modes that hold host memory for sleep ahead of need
            warm=lambda: self._warmer(read_only=True),
        )
        if host_buffer != "first_sleep":
            self._host = HostCopy(self._total, self.device, piece_bytes, warm=self._warmer(read_only=False))
            self._host.prepare()
            if host_buffer == "at_start":
                self._host.wait()

    def _collect(self) -> Iterator[_Entry]:
        offset = 0
        for weight_file in self.files:
            for prefix, module in weight_file.parts.items():
                persistent = module.state_dict(keep_vars=True)
                ids = {id(t) for t in persistent.values()}
                # (checkpoint key, qualified name, tensor); key "" marks a non-persistent buffer.
                tensors = [(prefix + k, prefix + k, t) for k, t in persistent.items()]
                tensors += [("", prefix + n, t) for n, t in module.named_buffers() if id(t) not in ids]
                for key, name, tensor in tensors:
                    if not weight_file.manages(name):
                        continue
                    nbytes = tensor.numel() * tensor.element_size()
                    yield _Entry(Path(weight_file.path), key, tensor, tensor.shape, tensor.dtype, offset, nbytes)
                    offset += _aligned(nbytes)

    @property
    def weight_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    @property
    def host_bytes(self) -> int:
        """Host memory the level-1 buffer holds now (0 when there is none)."""
        return self._host.nbytes if self._host is not None else 0

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the checkpoint held mapped (on a GPU: page-locked) between level-2 wakes."""
        return self._checkpoint.held_bytes

    def host_stats(self) -> dict[str, float]:
        """How the level-1 buffer was prepared: bytes, locked_bytes, fault_s, lock_s, warm_s, ready_s."""
        return self._host.stats() if self._host is not None else {}

    def fill_stats(self) -> dict[str, float]:
        """How the last level-2 wake read the checkpoint (`CheckpointSource.stats`)."""
        return self._checkpoint.stats()

    def settle(self) -> None:
        """Wait until the last level-2 wake has undone its locks and unmapped the checkpoint
        (done on a thread after the wake returns, off its path, unless the checkpoint is held).
        Sleep and wake settle first."""
        self._checkpoint.settle()

    def close(self) -> None:
        """Give back the host memory this controller holds (the worker's end)."""
        self._checkpoint.close()
        self._drop_host()

    def _drop_host(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None

    def _warmer(self, read_only: bool) -> WarmDma | None:
        if self._warm_dma == "off" or not platform.is_cuda(self.device):
            return None
        return WarmDma(self.device, self._warm_dma, read_only=read_only)

    def compact(self, holders: Sequence[DeviceHolder] = ()) -> None:
        """Move the weights into one device allocation through the level-1 buffer (a sleep and
        a wake; `holders` as for sleep). A no-op once they are in one, or while asleep."""
        if self.level or self._device_flat is not None:
            return
        self.sleep(1, holders)
        self.wake()

    # sleep ------------------------------------------------------------------------------------
    def sleep(self, level: int, holders: Sequence[DeviceHolder] = ()) -> SleepResult:
        """`holders`: further device memory to release with the weights (restored by wake)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        started = time.perf_counter()
        self.settle()
        if self.level:  # already asleep: 1 -> 2 drops a lazily made host copy; anything else is a no-op
            if level == 2 and self.level == 1:
                if self.host_buffer == "first_sleep":
                    self._drop_host()
                self.level = 2
                self._checkpoint.hold()
            # A shallower request leaves the deeper state: report the level the stage is at.
            return SleepResult(self.level, 0, (time.perf_counter() - started) * 1e3)
        before = self._free_memory()
        released = self._storage_bytes()
        copy_started = time.perf_counter()
        if level == 1:
            self._copy_to_host()
        release_started = time.perf_counter()
        self._holders = list(holders)
        released += sum(h.release_device() for h in self._holders)
        for e in self._entries:
            if level == 2 and not e.key:
                # Non-persistent buffers cannot be reloaded from the checkpoint: keep them, but not
                # as views into the shared weight buffer of a previous wake, which they would keep alive.
                if self._device_flat is not None and (
                    e.tensor.data.untyped_storage().data_ptr() == self._device_flat.untyped_storage().data_ptr()
                ):
                    e.tensor.data = e.tensor.data.clone()
                continue
            e.tensor.data = torch.empty(0, dtype=e.dtype, device=self.device)
        if level == 2:
            released -= sum(e.nbytes for e in self._entries if not e.key)
        compact = self._device_flat is not None
        self._device_flat = None  # the last reference: the flat buffer goes back with the release
        freed = self._release(before, released, collect=not compact)
        self.last_sleep_phases = {
            "copy_s": release_started - copy_started,
            "release_s": time.perf_counter() - release_started,
        }
        self.level = level
        if level == 2:
            self._checkpoint.hold()  # in the modes that hold it: locked while the stage sleeps
        return SleepResult(level, freed, (time.perf_counter() - started) * 1e3)

    def _copy_to_host(self) -> None:
        if self._host is None:
            self._host = HostCopy(self._total, self.device, self._piece_bytes).prepare()
        host = self._host
        if self._device_flat is not None:  # after a wake: one range, copied piece by piece
            sources, spans = [self._device_flat], [(0, self._total)]
        else:
            sources = [_bytes(e.tensor.data) for e in self._entries]
            spans = [(e.offset, e.nbytes) for e in self._entries]
        ranges = Ranges(spans)
        stream = platform.Stream(self.device)
        stream.wait_event(platform.DeviceEvent(self.device).record())  # weights are final
        try:
            with stream.active():
                for piece in host.ready():  # each as soon as it is faulted in and locked
                    for i, lo, hi in ranges.within(piece):  # a copy stays inside one locked piece
                        src = sources[i][lo - spans[i][0] : hi - spans[i][0]]
                        host.tensor[lo:hi].copy_(src, non_blocking=piece.locked)
        except BaseException:
            stream.synchronize()
            self.close()  # a buffer that could not be prepared is made afresh by the next sleep
            raise
        stream.synchronize()

    # wake -------------------------------------------------------------------------------------
    def wake(self) -> SleepResult:
        started = time.perf_counter()
        level = self.level
        if not level:
            return SleepResult(0, 0, 0.0)
        self.settle()
        before = self._free_memory()
        flat = torch.empty(self._total, dtype=torch.uint8, device=self.device)
        if level == 1:
            assert self._host is not None, "a level-1 sleep keeps the host copy"
            for piece in self._host.ready():  # a copy stays inside one locked piece
                span = slice(piece.start, piece.end)
                flat[span].copy_(self._host.tensor[span], non_blocking=piece.locked)
        else:
            self._checkpoint.fill(flat)
        for e in self._entries:
            if level == 2 and not e.key:
                continue
            e.tensor.data = flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
        restored = sum(h.restore_device() for h in self._holders)
        self._holders = []
        if platform.is_cuda(self.device):
            torch.cuda.synchronize(self.device)
        self._device_flat = flat
        self.level = 0
        cuda = platform.is_cuda(self.device)
        taken = before - self._free_memory() if cuda else self._storage_bytes() + restored
        return SleepResult(level, taken, (time.perf_counter() - started) * 1e3)

    # measurement ------------------------------------------------------------------------------
    def _free_memory(self) -> int:
        if platform.is_cuda(self.device):
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.mem_get_info(self.device)[0])
        return 0

    def _storage_bytes(self) -> int:
        """CPU stand-in for a device measurement: the bytes the managed tensors occupy, each
        storage counted once and never beyond what they view (a mapped file is not theirs)."""
        seen: dict[int, tuple[int, int]] = {}
        for e in self._entries:
            t = e.tensor.data
            storage = t.untyped_storage()
            cap, used = seen.get(storage.data_ptr(), (storage.nbytes(), 0))
            seen[storage.data_ptr()] = (cap, used + t.numel() * t.element_size())
        return sum(min(cap, used) for cap, used in seen.values())

    def _release(self, free_before: int, released_storage: int, collect: bool) -> int:
        """Return memory to the device and measure it; on the CPU, the storage bytes dropped."""
        if platform.is_cuda(self.device):
            if collect:
                gc.collect()  # first sleep: reference cycles may still hold the loaded tensors
            # cuBLAS keeps workspaces in the caching allocator; they count as the stage's memory too.
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()
            return self._free_memory() - free_before
        return released_storage

"""Giving a worker's device memory back and taking it again.

Level 1 copies every weight into one exact-size host buffer (pinned on a GPU, reused across
cycles) and frees the device copies; level 2 frees them without a copy. Waking allocates one
device buffer for all weights and fills it from the host buffer (level 1) or from the
checkpoint through a memory map (level 2). The Parameter and buffer objects stay the same
throughout: only their storage changes, so nothing that holds a module sees a difference.

The controller manages what a runner's `weight_files()` names; a runner may leave tensors out
(`WeightFile.skip`: those a layerwise offload engine streams from its own host copies) and hand
over `DeviceHolder`s for other device memory it owns (the engine's slots): they are released
inside the measured window of a sleep and restored on wake.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from stagemesh.stage_service import platform
from stagemesh.stage_service.models.contract import DeviceHolder, WeightFile
from stagemesh.stage_service.worker.reload import Copy, Reloader
from stagemesh.weight_store.checkpoint import read_index

_ALIGN = 64  # bytes: every tensor starts on a 64-byte boundary of the flat buffers


@dataclass
class _Entry:
    key: str  # checkpoint key, or "" for a non-persistent buffer
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
    def __init__(self, files: list[WeightFile], device: str):
        self.device = torch.device(device)
        self.files = files
        self.level = 0
        self._entries = list(self._collect())
        self._total = _aligned(sum(_aligned(e.nbytes) for e in self._entries))
        self._host: torch.Tensor | None = None  # level-1 copy, kept for reuse across cycles
        self._device_flat: torch.Tensor | None = None  # set once the weights live in one buffer
        self._reloader = Reloader(self.device)
        self._holders: list[DeviceHolder] = []  # released by the last sleep, restored on wake

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
                    yield _Entry(key, tensor, tensor.shape, tensor.dtype, offset, nbytes)
                    offset += _aligned(nbytes)

    @property
    def weight_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    # sleep ------------------------------------------------------------------------------------
    def sleep(self, level: int, holders: Sequence[DeviceHolder] = ()) -> SleepResult:
        """`holders`: further device memory to release with the weights (restored by wake)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        started = time.perf_counter()
        if self.level:  # already asleep: 1 -> 2 drops the host copy; anything else is a no-op
            if level == 2 and self.level == 1:
                self._host = None
                self._reloader.prepare()
                self.level = 2
            # A shallower request leaves the deeper state: report the level the stage is at.
            return SleepResult(self.level, 0, (time.perf_counter() - started) * 1e3)
        before = self._free_memory()
        released = self._storage_bytes()
        if level == 1:
            self._copy_to_host()
        else:
            self._reloader.prepare()  # pin the staging chunks now, not on the wake path
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
        self.level = level
        return SleepResult(level, freed, (time.perf_counter() - started) * 1e3)

    def _copy_to_host(self) -> None:
        pin = platform.is_cuda(self.device)
        if self._host is None or self._host.numel() != self._total:
            self._host = torch.empty(self._total, dtype=torch.uint8, pin_memory=pin)
        stream = platform.Stream(self.device)
        stream.wait_event(platform.DeviceEvent(self.device).record())  # weights are final
        with stream.active():
            if self._device_flat is not None:  # after a wake: one copy at full bandwidth
                self._host.copy_(self._device_flat, non_blocking=pin)
            else:
                for e in self._entries:
                    self._host[e.offset : e.offset + e.nbytes].copy_(_bytes(e.tensor.data), non_blocking=pin)
        stream.synchronize()

    # wake -------------------------------------------------------------------------------------
    def wake(self) -> SleepResult:
        started = time.perf_counter()
        level = self.level
        if not level:
            return SleepResult(0, 0, 0.0)
        before = self._free_memory()
        flat = torch.empty(self._total, dtype=torch.uint8, device=self.device)
        if level == 1:
            assert self._host is not None, "a level-1 sleep keeps the host copy"
            flat.copy_(self._host, non_blocking=True)
        else:
            self._fill_from_checkpoint(flat)
        for e in self._entries:
            if level == 2 and not e.key:
                continue
            e.tensor.data = flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
        restored = sum(h.restore_device() for h in self._holders)
        self._holders = []
        if platform.is_cuda(self.device):
            torch.cuda.synchronize(self.device)
        self._device_flat = flat
        self._reloader.release()
        self.level = 0
        cuda = platform.is_cuda(self.device)
        taken = before - self._free_memory() if cuda else self._storage_bytes() + restored
        return SleepResult(level, taken, (time.perf_counter() - started) * 1e3)

    def _fill_from_checkpoint(self, flat: torch.Tensor) -> None:
        by_key = {e.key: e for e in self._entries if e.key}
        copies: list[Copy] = []
        found: set[str] = set()
        for weight_file in self.files:
            for key, record in read_index(weight_file.path).items():
                e = by_key.get(key)
                if e is None:
                    continue
                if record.shape != tuple(e.shape) or record.dtype != e.dtype:
                    raise ValueError(
                        f"{weight_file.path}: {key} is {record.shape} {record.dtype}, "
                        f"the model holds {tuple(e.shape)} {e.dtype}"
                    )
                copies.append(Copy(weight_file.path, record.file_offset, e.offset, e.nbytes))
                found.add(key)
        missing = sorted(by_key.keys() - found)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) to reload, e.g. {missing[:3]}")
        self._reloader.fill(flat, copies)

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

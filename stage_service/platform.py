"""The one place that knows about device streams and events.

On a CUDA device these are real streams and events; on the CPU every operation is a safe no-op
(work is already complete when a CPU kernel returns), so the same worker code runs everywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import time
import weakref
from collections.abc import Callable, Iterator

import torch


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


class DeviceEvent:
    """Marks a point on a stream; other streams (or the host) can wait for it. With `timing`,
    two events also measure the device time between them (on the CPU: the host clock). A host
    thread waiting on a `blocking` event sleeps until it completes instead of spinning."""

    def __init__(self, device: str | torch.device, timing: bool = False, blocking: bool = False):
        self._event = torch.cuda.Event(enable_timing=timing, blocking=blocking) if is_cuda(device) else None
        self._host_time = 0.0

    def record(self, stream: Stream | None = None) -> DeviceEvent:
        if self._event is not None:
            self._event.record(stream.raw if stream is not None else None)
        else:
            self._host_time = time.perf_counter()
        return self

    def seconds_since(self, start: DeviceEvent) -> float:
        """Seconds from `start` to this event (both timing events); waits for this one."""
        if self._event is None:
            return self._host_time - start._host_time
        self._event.synchronize()
        assert start._event is not None, "both events must be timing events of one device"
        return start._event.elapsed_time(self._event) / 1e3

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def query(self) -> bool:
        return True if self._event is None else self._event.query()

    @property
    def raw(self):
        return self._event


class Stream:
    """A side stream (CUDA) or nothing (CPU). `priority`: CUDA's stream priority, lower runs
    first when both have work waiting for the multiprocessors (0 is the default, -1 high)."""

    def __init__(self, device: str | torch.device, priority: int = 0):
        self.device = torch.device(device)
        self.raw = torch.cuda.Stream(device=self.device, priority=priority) if is_cuda(device) else None

    def wait_event(self, event: DeviceEvent) -> None:
        if self.raw is not None and event.raw is not None:
            self.raw.wait_event(event.raw)

    def synchronize(self) -> None:
        if self.raw is not None:
            self.raw.synchronize()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this the current stream of the calling thread for the block."""
        if self.raw is None:
            yield
        else:
            with torch.cuda.stream(self.raw):
                yield


def host_buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor to copy `tensor` into: pinned when the source is on a CUDA device, so the
    copy can be asynchronous."""
    pin = tensor.device.type == "cuda"
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)


def to_device(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`. To a CUDA device through pinned memory without
    blocking: a copy from pageable memory waits for the device to finish all queued work, so the
    next batch could not be queued while the previous one still runs."""
    if not is_cuda(device) or tensor.device.type != "cpu":
        return tensor.to(device)
    # The pinned block is torch's (cached); the copy records its use, so it is not reused early.
    return tensor.pin_memory().to(device, non_blocking=True)


def record_stream(tensor: torch.Tensor, stream: Stream) -> None:
    """Tell the caching allocator that `stream` uses `tensor`, so its memory is not reused early."""
    if stream.raw is not None and tensor.device.type == "cuda":
        tensor.record_stream(stream.raw)


def memory_allocated(device: str | torch.device) -> int:
    return int(torch.cuda.memory_allocated(torch.device(device))) if is_cuda(device) else 0


def current_stream(device: str | torch.device) -> Stream:
    """The calling thread's current stream on `device` (the compute stream), or a CPU no-op."""
    stream = Stream.__new__(Stream)
    stream.device = torch.device(device)
    stream.raw = torch.cuda.current_stream(stream.device) if is_cuda(device) else None
    return stream


def _page_backed(nbytes: int) -> torch.Tensor:
    # An anonymous mapping: page-aligned pages that no other allocation shares, so registering
    # them can never collide with a neighbour's registration.
    pages = mmap.mmap(-1, max(1, -(-nbytes // mmap.PAGESIZE)) * mmap.PAGESIZE)
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes)


class HostBuffer:
    """A flat uint8 host buffer of exactly `nbytes`.

    For a CUDA target the pages are page-locked with cudaHostRegister, so H2D copies are truly
    asynchronous; torch's pinned allocator would round each buffer up to a power of two. The
    registration ends before the memory can be freed (close(), or when this object dies; CPython
    runs weakref callbacks before it drops the tensor). On the CPU it is plain memory.
    """

    def __init__(self, nbytes: int, for_device: str | torch.device):
        self.pinned = False
        self._finalizer: weakref.finalize | None = None
        if nbytes and is_cuda(for_device):
            self.tensor = _page_backed(nbytes)
            self._pin()
        else:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)

    def _pin(self) -> None:
        ptr, size = self.tensor.data_ptr(), self.tensor.numel()
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(ptr, size, 0)) == 0:
            self.pinned = True
            self._finalizer = weakref.finalize(self, cudart.cudaHostUnregister, ptr)
        else:
            # Registration refused (e.g. a locked-memory limit): fall back to torch's allocator.
            self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self.pinned = True

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


# cudaHostRegisterReadOnly: the device only reads, so pages of a file mapping are locked in place
# without being made writable (a write pin of a private mapping would copy every page).
REGISTER_READ_ONLY = 8


def clear_cuda_error() -> None:
    """A refused registration leaves its error pending in the runtime; torch would report it at
    the next kernel launch. Read it (which clears it) through the runtime torch loaded."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def lock_host_range(ptr: int, nbytes: int, device: str | torch.device, read_only: bool = False):
    """Page-lock host bytes [ptr, ptr + nbytes) for DMA by `device` (cudaHostRegister), from any
    thread (the call releases the GIL). Returns the function that undoes it (call it before the
    memory goes away), or None when `device` is not a CUDA device or the driver refuses. A copy
    must stay inside one locked range: one spanning two registrations fails."""
    if not nbytes or not is_cuda(device):
        return None
    cudart = torch.cuda.cudart()
    with torch.cuda.device(torch.device(device)):  # a fresh thread's current device is cuda:0
        refused = int(cudart.cudaHostRegister(ptr, nbytes, REGISTER_READ_ONLY if read_only else 0))
    if refused:
        clear_cuda_error()  # the error is the calling thread's: read it here
        return None
    return functools.partial(cudart.cudaHostUnregister, ptr)


def lock_pages_in_place(tensor: torch.Tensor, device: str | torch.device) -> Callable[[], object] | None:
    """Page-lock the memory under `tensor`'s storage where it is (e.g. a file mapping), so H2D
    copies from it are DMA with no staging copy. Returns a function that undoes it (call it
    before the memory goes away), or None when the target is not a CUDA device or the driver
    refuses (the caller then stages instead)."""
    storage = tensor.untyped_storage()
    return lock_host_range(storage.data_ptr(), storage.nbytes(), device, read_only=True)


# ---- host memory prepared ahead of copies -----------------------------------------------------------
HUGE_PAGE = 2 << 20
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14: fault a range in with one call
_libc = ctypes.CDLL(None, use_errno=True)


def anonymous_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` over a private anonymous mapping of its own, starting on a
    2 MiB boundary (where transparent huge pages are on for every mapping, the kernel can use
    them). Huge pages are not asked for: under the default defrag policy that makes faults
    compact memory synchronously, seconds per 256 MiB on a fragmented host. No page is touched
    yet (see `fault_in`); the mapping is unmapped when the last tensor over it goes."""
    size = max(1, -(-nbytes // mmap.PAGESIZE)) * mmap.PAGESIZE
    pages = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + nbytes]


def fault_in(tensor: torch.Tensor, write: bool = True) -> None:
    """Map the pages under `tensor` (a contiguous slice of an `anonymous_buffer`, or of a file
    mapping with `write=False`) into this process now, so that neither a copy nor
    cudaHostRegister takes their page faults one by one later. A written buffer's contents are
    undefined afterwards. Threads may fault disjoint slices at once: neither path holds the GIL."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return
    start = tensor.data_ptr() - tensor.data_ptr() % mmap.PAGESIZE
    length = tensor.data_ptr() + nbytes - start
    advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0:
        return
    err = ctypes.get_errno()
    if err != errno.EINVAL:  # out of memory, say: touching the pages would only summon the OOM killer
        raise OSError(err, f"cannot fault in {nbytes} bytes of host memory: {os.strerror(err)}")
    if not write:
        return  # an older kernel (or a sandbox): the copy will fault the pages in itself
    # Without MADV_POPULATE_WRITE: write one byte in every page.
    flat = tensor.reshape(-1).view(torch.uint8)
    flat[:: mmap.PAGESIZE].zero_()
    flat[-1:].zero_()

"""Host memory page-locked piece by piece on background threads, ahead of the copies that use it.

cudaHostRegister of a 20 GB range takes seconds (it faults in and pins every page), and a copy
must stay inside one registered range. So a region is cut into fixed pieces: threads fault each
piece in (for a fresh anonymous buffer) and lock it, in order, while the caller already copies
to or from the pieces that are ready. The level-1 host copy (`HostCopy`) and the level-2 wake
from the checkpoint mapping (`reload.MappedFill`) both go through `LockedPieces`.

The first DMA through freshly registered pages runs slower than later ones (the first level-1
sleep into a buffer prepared ahead copied at 0.77x pinned bandwidth, later ones at 0.97x, on the
H200). `WarmDma` can send one DMA through each piece on the locking thread before it is handed
out; on the H200 that did not change the first sleep (0.767-0.800x for every variant, one run), so
`WARM_DMA` is "off" and the knob stays for bench/sleep_wake.py, which prints each variant.

On the CPU nothing is locked; the same threads fault the pages in, and every piece is usable as
it is.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from stagemesh.core import logs
from stagemesh.stage_service import platform

log = logs.get_logger("stagemesh.worker.sleep")

PIECE_BYTES = 256 << 20  # small enough that the first piece is ready in milliseconds
LOCK_THREADS = 2  # registrations the driver may serve at once; more only queue
FAULT_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))  # faults scale with cores, up to memory bandwidth

WARM_DMAS = ("off", "page", "piece")
# "page": a 4 KiB copy into every 2 MiB of a piece; "piece": every byte of it. Measured on the H200
# (first level-1 sleep after each): off 0.769x, page 0.800x, piece 0.767x: no gain worth 1.2 s.
WARM_DMA = "off"

Prefetch = Callable[[int, int], None]  # (start, end) of a piece: start reading it from disk
Warm = Callable[[torch.Tensor], None]  # a locked piece of the region: send one DMA through it


class Cancelled(RuntimeError):
    """The pieces were given back (unlock()) before this one was ready."""


@dataclass
class Piece:
    start: int  # byte offsets into the region
    end: int
    locked: bool = False  # page-locked: copies to or from it may be asynchronous
    direct: bool = False  # copies may use it as it is (locked, or nothing needs locking)
    undo: Callable[[], object] | None = None
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def piece_spans(nbytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """[start, end) of every piece of a region of `nbytes`."""
    return [(s, min(s + piece_bytes, nbytes)) for s in range(0, nbytes, piece_bytes)]


def touched_spans(ranges: Sequence[tuple[int, int]], size: int, piece_bytes: int) -> list[tuple[int, int]]:
    """The pieces of a region of `size` that any (start, nbytes) range touches, in order."""
    touched: set[int] = set()
    for start, n in ranges:
        if n:
            touched.update(range(start // piece_bytes, (start + n - 1) // piece_bytes + 1))
    return [(k * piece_bytes, min((k + 1) * piece_bytes, size)) for k in sorted(touched)]


class Ranges:
    """Disjoint (start, nbytes) ranges of a region, looked up by the piece they overlap."""

    def __init__(self, ranges: Sequence[tuple[int, int]]):
        self._order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        self._starts = [ranges[i][0] for i in self._order]
        self._ends = [ranges[i][0] + ranges[i][1] for i in self._order]  # sorted too: disjoint

    def within(self, piece: Piece) -> Iterator[tuple[int, int, int]]:
        """(index, start, end) of the part of each range inside `piece`, in address order."""
        first = bisect.bisect_right(self._ends, piece.start)
        last = bisect.bisect_left(self._starts, piece.end)
        for k in range(first, last):
            lo, hi = max(self._starts[k], piece.start), min(self._ends[k], piece.end)
            if lo < hi:
                yield self._order[k], lo, hi


class WarmDma:
    """One DMA through each piece it is called with, from (or, for `read_only` memory, into) a
    2 MiB device scratch, on the calling thread's own stream; returns once it has landed. `mode`
    is one of WARM_DMAS ("off" does nothing). The scratch's contents are never looked at: a
    piece warmed for writing holds nothing of value until the caller copies into it."""

    def __init__(self, device: str | torch.device, mode: str = WARM_DMA, read_only: bool = False):
        if mode not in WARM_DMAS:
            raise ValueError(f"warm_dma = {mode!r}; allowed: {', '.join(WARM_DMAS)}")
        self.device = torch.device(device)
        self.mode = mode
        self._read_only = read_only
        self._scratch = torch.empty(platform.HUGE_PAGE, dtype=torch.uint8, device=self.device)
        self._local = threading.local()

    def __call__(self, piece: torch.Tensor) -> None:
        if self.mode == "off":
            return
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = platform.Stream(self.device)
        length = mmap.PAGESIZE if self.mode == "page" else platform.HUGE_PAGE
        with torch.cuda.device(self.device), stream.active():
            for start in range(0, piece.numel(), platform.HUGE_PAGE):
                host = piece[start : start + length]
                dev = self._scratch[: host.numel()]
                if self._read_only:
                    dev.copy_(host, non_blocking=True)
                else:
                    host.copy_(dev, non_blocking=True)
        stream.synchronize()


def _undo_all(pieces: list[Piece]) -> None:
    for p in pieces:
        if p.undo is not None:
            p.undo()
            p.undo, p.locked = None, False


class LockedPieces:
    """Pieces of `region` (a uint8 host tensor) made ready in order on background threads: each
    faulted in (`fault`, for fresh anonymous memory) and page-locked for `device`; `prefetch`
    starts reading pieces of a file mapping from disk ahead of the locks that fault them in;
    `warm` is called with each piece once it is locked, before it is ready (a `WarmDma`).
    `must_lock`: whether a piece must be locked before copies use it directly (default: a CUDA
    target); a piece the driver refuses to lock is not `direct`, and the caller stages it."""

    def __init__(
        self,
        region: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        device: str | torch.device,
        *,
        read_only: bool = False,
        fault: bool = False,
        prefetch: Prefetch | None = None,
        must_lock: bool | None = None,
        warm: Warm | None = None,
        on_ready: Callable[[LockedPieces], object] | None = None,
    ) -> None:
        self.region = region
        self.pieces = [Piece(s, e) for s, e in spans]
        self.device = device
        self._read_only = read_only
        self._fault = fault
        self._prefetch = prefetch
        self._must_lock = platform.is_cuda(device) if must_lock is None else must_lock
        self._warm = warm
        self._cancelled = threading.Event()  # set by unlock(): pieces not yet begun are skipped
        self._on_ready = on_ready  # called on the background thread once every piece is ready
        self._thread: threading.Thread | None = None
        self._timing_lock = threading.Lock()
        self.lock_s = 0.0  # summed over the locking threads
        self.warm_s = 0.0  # summed over the locking threads
        self.locks = 0  # ranges locked (each undone once, by unlock() or when this object goes)
        self.fault_s = 0.0  # wall time of the fault phases
        self.ready_s = 0.0  # from start() until the last piece was ready
        # Every lock is undone before the region can go, also when unlock() is never called.
        self._finalizer = weakref.finalize(self, _undo_all, self.pieces)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def locked_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces if p.locked)

    def start(self) -> LockedPieces:
        """Begin on background threads (once); returns at once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sleep-pages", daemon=True)
            self._thread.start()
        return self

    def __iter__(self) -> Iterator[Piece]:
        """Each piece in order, once it is ready (starting the work if need be)."""
        self.start()
        for p in self.pieces:
            p.ready.wait()
            if p.error is not None:
                raise p.error
            yield p

    def wait(self) -> None:
        for _ in self:
            pass

    def unlock(self) -> None:
        """Stop the background work (a piece being locked is finished, the rest skipped), then
        undo every lock (idempotent)."""
        self._cancelled.set()
        if self._thread is not None:
            self._thread.join()
        self._finalizer()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            with ThreadPoolExecutor(LOCK_THREADS, "sleep-lock") as lockers:
                if self._fault:
                    with ThreadPoolExecutor(FAULT_THREADS, "sleep-fault") as faulters:
                        for p in self.pieces:
                            if self._cancelled.is_set():
                                break
                            faulted = time.perf_counter()
                            # Every thread faults a part of this piece; it is locked while the next one faults.
                            list(faulters.map(platform.fault_in, self._parts(p, FAULT_THREADS)))
                            self.fault_s += time.perf_counter() - faulted
                            lockers.submit(self._lock, p)
                else:
                    for p in self.pieces:
                        lockers.submit(self._lock, p)
                    if self._prefetch is not None:
                        for p in self.pieces:
                            if self._cancelled.is_set():
                                break
                            self._prefetch(p.start, p.end)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the pieces
            for p in self.pieces:
                if not p.ready.is_set():
                    p.error = exc
                    p.ready.set()
            return
        finally:
            self._warm = None  # its device scratch goes back
        self.ready_s = time.perf_counter() - started
        for p in self.pieces:
            if not p.ready.is_set():  # cancelled before its turn
                p.error = Cancelled("the pieces were given back")
                p.ready.set()
        if self._cancelled.is_set():
            return
        if self._on_ready is not None:
            self._on_ready(self)

    def _parts(self, p: Piece, n: int) -> list[torch.Tensor]:
        step = -(-p.nbytes // n)
        return [self.region[s : min(s + step, p.end)] for s in range(p.start, p.end, step)]

    def _lock(self, p: Piece) -> None:
        if self._cancelled.is_set():
            return  # _run marks it
        started = time.perf_counter()
        warmed = started
        try:
            p.undo = platform.lock_host_range(
                self.region.data_ptr() + p.start, p.nbytes, self.device, read_only=self._read_only
            )
            p.locked = p.undo is not None
            p.direct = p.locked or not self._must_lock
            if p.direct and not p.locked and not self._fault:
                # Nothing locks it (a CPU target): map it in here, off the copying thread.
                platform.fault_in(self.region[p.start : p.end], write=not self._read_only)
            warmed = time.perf_counter()
            if p.locked and self._warm is not None:
                self._warm(self.region[p.start : p.end])
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the piece
            p.error = exc
        finally:
            with self._timing_lock:
                self.locks += p.locked
                self.lock_s += warmed - started
                self.warm_s += time.perf_counter() - warmed
            p.ready.set()


class HostCopy:
    """The level-1 host copy of the weights: one anonymous mapping of their size (no power-of-two
    rounding), faulted in and page-locked piece by piece, kept across sleep cycles. `prepare()`
    starts that in the background; a sleep copies into each piece as soon as it is ready.
    `warm`: a `WarmDma` to send through each piece once it is locked (for a buffer prepared
    ahead, off the sleep's path)."""

    def __init__(
        self, nbytes: int, device: str | torch.device, piece_bytes: int = PIECE_BYTES, warm: Warm | None = None
    ):
        self.tensor = platform.anonymous_buffer(nbytes)
        self.pieces = LockedPieces(
            self.tensor, piece_spans(nbytes, piece_bytes), device, fault=True, warm=warm, on_ready=_log_ready
        )

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def prepare(self) -> HostCopy:
        self.pieces.start()
        return self

    def ready(self) -> Iterator[Piece]:
        """The pieces in order, each once it is faulted in and locked."""
        return iter(self.pieces)

    def wait(self) -> None:
        self.pieces.wait()

    def close(self) -> None:
        self.pieces.unlock()

    def stats(self) -> dict[str, float]:
        p = self.pieces
        return {
            "bytes": self.nbytes,
            "locked_bytes": p.locked_bytes,
            "fault_s": p.fault_s,
            "lock_s": p.lock_s,
            "warm_s": p.warm_s,
            "ready_s": p.ready_s,
        }


def _log_ready(p: LockedPieces) -> None:
    if p.locked_bytes < p.nbytes and platform.is_cuda(p.device):
        log.warning(
            "sleep host buffer partly pageable (the driver refused to lock it): level-1 copies "
            "into the rest are synchronous",
            bytes=p.nbytes,
            locked_bytes=p.locked_bytes,
        )
    log.info(
        "sleep host buffer ready",
        bytes=p.nbytes,
        locked_bytes=p.locked_bytes,
        pieces=len(p.pieces),
        fault_s=round(p.fault_s, 3),
        warm_s=round(p.warm_s, 3),
        seconds=round(p.ready_s, 3),
    )

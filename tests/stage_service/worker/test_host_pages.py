"""Host memory locked piece by piece (worker/host_pages.py) and the level-2 fill straight from a
checkpoint mapping (worker/reload.py), on the CPU.

No CUDA device here: where a test needs pages to be locked, or refused, `platform.lock_host_range`
is replaced by a recorder (the driver is what cannot exist here); the mappings, faults, threads
and copies are real.
"""

from __future__ import annotations

import gc
import mmap
import random
import resource
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stagemesh.stage_service import platform
from stagemesh.stage_service.worker import host_pages, reload
from stagemesh.stage_service.worker.host_pages import (
    Cancelled,
    HostCopy,
    Piece,
    Ranges,
    WarmDma,
    piece_spans,
    touched_spans,
)
from stagemesh.stage_service.worker.reload import Copy, MappedFill, Reloader
from stagemesh.weight_store import checkpoint
from stagemesh.weight_store.checkpoint import read_index

PAGE = mmap.PAGESIZE
WAIT_S = 10.0


class LockRecorder:
    """Stands in for cudaHostRegister: records each range, refuses the pieces at `refuse` offsets."""

    def __init__(self, refuse: tuple[int, ...] = (), fail_at: int | None = None):
        self.refuse, self.fail_at = refuse, fail_at
        self.locked: list[tuple[int, int, bool]] = []
        self.unlocked: list[int] = []
        self.base = 0  # the region's address, to read offsets back

    def __call__(self, ptr: int, nbytes: int, device, read_only: bool = False):
        offset = ptr - self.base
        if offset == self.fail_at:
            raise RuntimeError("the driver fell over")
        if offset in self.refuse:
            return None
        self.locked.append((offset, nbytes, read_only))
        return lambda: self.unlocked.append(offset)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


# ---- pieces and ranges ----------------------------------------------------------------------------
def test_pieces_cover_the_region_and_ranges_split_exactly_at_piece_edges():
    rng = random.Random(7)
    for _ in range(50):
        piece_bytes = PAGE * rng.randint(1, 4)
        # Disjoint ranges in random order, some empty, some crossing several pieces.
        cuts = sorted(rng.sample(range(1, 40 * PAGE), 20))
        ranges = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2])] + [(cuts[-1], 0)]
        rng.shuffle(ranges)
        size = 40 * PAGE + rng.randint(0, PAGE)
        spans = piece_spans(size, piece_bytes)
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        touched = touched_spans(ranges, size, piece_bytes)
        lookup = Ranges(ranges)
        covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(ranges))}
        for start, end in touched:
            for i, lo, hi in lookup.within(Piece(start, end)):
                assert start <= lo < hi <= end  # never across a piece edge
                covered[i].append((lo, hi))
        for i, (start, n) in enumerate(ranges):
            parts = sorted(covered[i])
            if not n:
                assert parts == []
                continue
            assert parts[0][0] == start and parts[-1][1] == start + n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, no gap or overlap


# ---- anonymous buffers ----------------------------------------------------------------------------
def test_an_anonymous_buffer_is_exact_aligned_and_resident_only_once_faulted_in():
    nbytes = 24 << 20
    before = _rss()
    buf = platform.anonymous_buffer(nbytes)
    assert buf.numel() == nbytes and buf.dtype == torch.uint8
    assert buf.data_ptr() % platform.HUGE_PAGE == 0
    assert _rss() - before < nbytes // 4  # mapped, not yet touched
    platform.fault_in(buf[: nbytes // 2])
    platform.fault_in(buf[nbytes // 2 :])
    assert _rss() - before >= nbytes * 0.95  # every page resident now
    buf.fill_(3)
    assert int(buf.sum()) == 3 * nbytes
    del buf
    gc.collect()
    assert _rss() - before < nbytes // 4  # unmapped with its last tensor


# ---- LockedPieces ---------------------------------------------------------------------------------
def test_every_piece_is_faulted_locked_once_in_order_and_unlocked_once(monkeypatch):
    recorder = LockRecorder()
    monkeypatch.setattr(platform, "lock_host_range", recorder)
    size = 10 * PAGE + 123
    copy = HostCopy(size, "cpu", piece_bytes=3 * PAGE)
    recorder.base = copy.tensor.data_ptr()
    pieces = list(copy.prepare().ready())
    assert [(p.start, p.end) for p in pieces] == piece_spans(size, 3 * PAGE)
    assert all(p.locked and p.direct for p in pieces)
    assert sorted(recorder.locked) == [(p.start, p.nbytes, False) for p in pieces]  # each once, writable
    assert copy.stats()["locked_bytes"] == size
    copy.close()
    copy.close()
    assert sorted(recorder.unlocked) == [p.start for p in pieces]  # each once


def test_locks_are_undone_when_the_owner_is_dropped_without_close(monkeypatch):
    recorder = LockRecorder()
    monkeypatch.setattr(platform, "lock_host_range", recorder)
    copy = HostCopy(4 * PAGE, "cpu", piece_bytes=PAGE)
    recorder.base = copy.tensor.data_ptr()
    copy.wait()
    copy.pieces._thread.join()  # the background work is over: only the finalizer holds the locks
    del copy
    gc.collect()
    assert sorted(recorder.unlocked) == [0, PAGE, 2 * PAGE, 3 * PAGE]


def test_a_failure_on_a_background_thread_reaches_whoever_waits_for_that_piece(monkeypatch):
    recorder = LockRecorder(fail_at=2 * PAGE)
    monkeypatch.setattr(platform, "lock_host_range", recorder)
    copy = HostCopy(4 * PAGE, "cpu", piece_bytes=PAGE)
    recorder.base = copy.tensor.data_ptr()
    got = []
    with pytest.raises(RuntimeError, match="fell over"):
        for piece in copy.prepare().ready():
            got.append(piece.start)
    assert got == [0, PAGE]  # the pieces before it were usable
    copy.close()
    assert sorted(recorder.unlocked) == sorted(o for o, _, _ in recorder.locked)


def test_memory_prepared_ahead_is_warmed_once_per_locked_piece_before_it_is_handed_out(monkeypatch):
    recorder = LockRecorder(refuse=(PAGE,))  # a piece the driver refuses is not warmed: no DMA uses it
    monkeypatch.setattr(platform, "lock_host_range", recorder)
    warmed: list[tuple[int, int, bool]] = []

    def warm(piece: torch.Tensor) -> None:  # stands in for WarmDma (a device DMA)
        offset = piece.data_ptr() - copy.tensor.data_ptr()
        handed_out = next(p for p in copy.pieces.pieces if p.start == offset).ready.is_set()
        warmed.append((offset, piece.numel(), handed_out))

    copy = HostCopy(4 * PAGE + 5, "cpu", piece_bytes=PAGE, warm=warm)
    recorder.base = copy.tensor.data_ptr()
    copy.prepare().wait()
    assert sorted(warmed) == [(0, PAGE, False), (2 * PAGE, PAGE, False), (3 * PAGE, PAGE, False), (4 * PAGE, 5, False)]
    assert copy.stats()["warm_s"] >= 0 and copy.pieces.locks == 4
    copy.close()


def test_a_warm_dma_mode_outside_the_list_is_refused():
    with pytest.raises(ValueError, match="off, page, piece"):
        WarmDma("cpu", "all")


def test_giving_pieces_back_while_they_are_prepared_stops_the_work_and_undoes_every_lock(monkeypatch):
    recorder = LockRecorder()
    gate = threading.Event()

    def slow_lock(ptr, nbytes, device, read_only=False):
        assert gate.wait(WAIT_S)
        return recorder(ptr, nbytes, device, read_only)

    monkeypatch.setattr(platform, "lock_host_range", slow_lock)
    copy = HostCopy(12 * PAGE, "cpu", piece_bytes=PAGE)
    recorder.base = copy.tensor.data_ptr()
    copy.prepare()
    closing = threading.Thread(target=copy.close)
    closing.start()
    assert copy.pieces._cancelled.wait(WAIT_S)  # close() has asked the work to stop ...
    gate.set()  # ... before any lock returned
    closing.join(WAIT_S)
    assert not closing.is_alive()
    assert len(recorder.locked) <= host_pages.LOCK_THREADS  # only those already under way
    assert sorted(recorder.unlocked) == sorted(o for o, _, _ in recorder.locked)
    with pytest.raises(Cancelled):
        copy.wait()


# ---- MappedFill -----------------------------------------------------------------------------------
def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate([3000, 17, 5000, 1, 2500, 800])}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def _copies(path: Path) -> tuple[list[Copy], dict[str, int], int]:
    copies, at, offset = [], {}, 0
    for name, record in sorted(read_index(path).items()):
        copies.append(Copy(path, record.file_offset, offset, record.nbytes))
        at[name] = offset
        offset += -(-record.nbytes // 64) * 64
    return copies, at, offset


@pytest.mark.parametrize("refuse", [(), (0, 2 * PAGE)], ids=["all-locked", "some-refused"])
def test_a_mapped_fill_copies_every_tensor_and_stages_the_pieces_the_driver_refuses(tmp_path, monkeypatch, refuse):
    path, tensors = _checkpoint(tmp_path)
    copies, at, total = _copies(path)
    recorder = LockRecorder(refuse)
    monkeypatch.setattr(platform, "lock_host_range", recorder)
    fill = MappedFill(copies, "cpu", piece_bytes=PAGE, must_lock=True)  # as a CUDA target would

    def map_and_note(fd):
        data = checkpoint.map_descriptor(fd)
        recorder.base = data.data_ptr()  # lock offsets are read against the mapping
        return data

    monkeypatch.setattr(reload, "map_descriptor", map_and_note)
    flat = torch.zeros(total, dtype=torch.uint8)
    fill.run(flat, Reloader("cpu"))
    for name, t in tensors.items():
        got = flat[at[name] : at[name] + t.numel() * 4].view(torch.float32)
        assert torch.equal(got, t), name
    file_size = path.stat().st_size
    refused = sum(min(o + PAGE, file_size) - o for o in refuse)
    data_start = min(c.file_offset for c in copies)
    assert fill.staged_bytes == refused - (data_start if 0 in refuse else 0)  # the header is never copied
    assert all(read_only for _, _, read_only in recorder.locked)  # the mapping is never made writable
    fill.close()
    fill.close()
    assert fill.locked_bytes == sum(n for _, n, _ in recorder.locked)  # still known after close()
    assert sorted(recorder.unlocked) == sorted(o for o, _, _ in recorder.locked)


def test_a_cpu_target_copies_straight_from_the_mapping(tmp_path):
    path, tensors = _checkpoint(tmp_path)
    copies, at, total = _copies(path)
    fill = MappedFill(copies, "cpu", piece_bytes=2 * PAGE)
    flat = torch.zeros(total, dtype=torch.uint8)
    fill.run(flat, Reloader("cpu"))
    assert fill.staged_bytes == 0 and fill.locked_bytes == 0  # nothing to lock, nothing staged
    fill.close()
    for name, t in tensors.items():
        assert torch.equal(flat[at[name] : at[name] + t.numel() * 4].view(torch.float32), t), name

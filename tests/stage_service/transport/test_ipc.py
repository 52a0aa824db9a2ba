"""Async output rule 4 (docs/ARCHITECTURE.md): packing for the worker -> executor queues (inline vs shared memory).

Everything here is real: real tensors, real segments in /dev/shm, real processes where a pid is
needed. No GPU is involved.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

from stagemesh.stage_service.transport import ipc
from tests.support.shm_guard import no_segment_left_behind, our_segments  # noqa: F401 - autouse fixture

SHM = Path("/dev/shm")


def roundtrip(obj, rank: int = 0):
    packed = ipc.Packer(os.getpid(), rank).pack(obj)
    return packed, ipc.unpack(packed)


# ---- threshold --------------------------------------------------------------------------------


def test_exactly_the_threshold_stays_inline():
    t = torch.arange(250_000, dtype=torch.float32)  # 1,000,000 bytes
    assert t.numel() * t.element_size() == ipc.SHM_THRESHOLD_BYTES == 1_000_000
    packed, back = roundtrip(t)
    assert packed.shm_name is None and packed.data is not None and len(packed.data) == 1_000_000
    assert torch.equal(back, t)


def test_one_byte_over_goes_to_shared_memory_and_the_reader_unlinks_it():
    t = torch.randint(0, 255, (1_000_001,), dtype=torch.uint8)
    packed = ipc.pack(t)
    assert packed.data is None and packed.shm_name is not None
    assert packed.nbytes == 1_000_001
    assert packed.shm_name.startswith(f"stagemesh-{os.getpid()}-0-")
    assert (SHM / packed.shm_name).exists()
    back = ipc.unpack(packed)
    assert not (SHM / packed.shm_name).exists(), "the reader must unlink the segment"
    assert torch.equal(back, t)


def test_small_slice_of_a_large_batch_storage_ships_only_its_bytes():
    """Batch-slice regression: the slice goes to shm (its storage is big) but carries only its
    own bytes, not the whole batch's storage."""
    batch = torch.randn(4, 512, 512)  # 4 MiB storage
    item = batch[2, :10, :10]  # 100 floats, non-contiguous view into the big storage
    assert item.untyped_storage().nbytes() == batch.numel() * 4
    packed, back = roundtrip(item)
    assert packed.shm_name is not None
    assert packed.nbytes == item.numel() * item.element_size() == 400
    assert torch.equal(back, item)
    assert back.untyped_storage().nbytes() == 400


def test_contiguous_row_of_a_batch_ships_only_the_row():
    batch = torch.randn(8, 300_000)
    row = batch[5]
    packed, back = roundtrip(row)
    assert packed.shm_name is not None and packed.nbytes == 1_200_000
    assert torch.equal(back, row)


def test_large_view_of_small_tensor_is_inline_and_empty_tensors_roundtrip():
    e = torch.empty(0, 3)
    packed, back = roundtrip(e)
    assert packed.shm_name is None and back.shape == (0, 3) and back.dtype == torch.float32
    # A zero-element slice of a big storage: shm (storage rule), zero bytes, still round-trips.
    z = torch.zeros(2_000_000, dtype=torch.uint8)[:0]
    packed, back = roundtrip(z)
    assert packed.shm_name is not None and packed.nbytes == 0 and back.shape == (0,)
    s = torch.tensor(3.5, dtype=torch.float64)
    packed, back = roundtrip(s)
    assert back.shape == () and back.item() == 3.5 and back.dtype == torch.float64


# ---- dtypes, views, containers -----------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int64, torch.uint8, torch.bool],
)
@pytest.mark.parametrize("n", [17, 600_001])  # inline and shm
def test_dtype_and_shape_roundtrip(dtype, n):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 50).to(dtype)
    packed, back = roundtrip(t.reshape(1, n))
    assert (packed.shm_name is not None) == (n * t.element_size() > ipc.SHM_THRESHOLD_BYTES)
    assert back.dtype == dtype and back.shape == (1, n)
    assert torch.equal(back, t.reshape(1, n))


def test_bf16_bit_exact_including_special_values():
    t = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), 3e38, 1e-40], dtype=torch.bfloat16)
    _, back = roundtrip(t)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


@pytest.mark.parametrize("big", [False, True])
def test_non_contiguous_views_roundtrip(big):
    side = 1000 if big else 10
    base = torch.randn(side, side + 3)
    views = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.randn(1, side).expand(4, side),
        "permuted": base.reshape(side, side + 3, 1).permute(1, 2, 0),
    }
    assert not any(v.is_contiguous() for v in views.values())
    _, back = roundtrip(views)
    for name, v in views.items():
        assert back[name].shape == v.shape, name
        assert torch.equal(back[name], v), name
        assert back[name].is_contiguous()


def test_nested_containers_become_new_containers_and_input_is_untouched():
    big = torch.randn(300_000)  # 1.2 MB -> shm
    small = torch.arange(6).reshape(2, 3)
    obj = {"a": [small, (big, 7, "x")], "b": {"c": None, "d": [1.5, small.t()]}, "e": ()}
    snapshot = {"a": [small.clone(), (big.clone(), 7, "x")], "b": {"c": None, "d": [1.5, small.t().clone()]}}
    packed, back = roundtrip(obj)

    # The input still holds the very same tensors and values.
    assert obj["a"][0] is small and obj["a"][1][0] is big and isinstance(obj["a"][1], tuple)
    assert torch.equal(obj["a"][1][0], snapshot["a"][1][0])
    # The packed and unpacked structures are new containers of the same types.
    for tree in (packed, back):
        assert tree is not obj and tree["a"] is not obj["a"] and tree["b"] is not obj["b"]
        assert type(tree["a"]) is list and type(tree["a"][1]) is tuple and type(tree["e"]) is tuple
        assert tree["a"][1][1:] == (7, "x") and tree["b"]["c"] is None and tree["b"]["d"][0] == 1.5
    assert isinstance(packed["a"][1][0], ipc.PackedTensor) and packed["a"][1][0].shm_name is not None
    assert isinstance(packed["a"][0], ipc.PackedTensor) and packed["a"][0].shm_name is None
    assert torch.equal(back["a"][0], small) and torch.equal(back["a"][1][0], big)
    assert torch.equal(back["b"]["d"][1], small.t())
    # Mutating the result does not reach the input.
    back["a"][0].fill_(-1)
    assert torch.equal(small, snapshot["a"][0])


def test_packed_payload_carries_no_torch_objects():
    import pickle

    packed = ipc.pack({"x": torch.randn(300_000), "y": torch.randn(3)})
    try:
        blob = pickle.dumps(packed)
        assert b"torch._utils" not in blob and b"rebuild_tensor" not in blob
    finally:
        ipc.unpack(packed)


# ---- cleanup -------------------------------------------------------------------------------------


def test_discard_unlinks_segments_of_an_unread_payload():
    packed = ipc.pack([{"x": torch.randn(300_000)}, {"x": torch.randn(300_000), "y": torch.randn(2)}])
    names = {packed[0]["x"].shm_name, packed[1]["x"].shm_name}
    assert names <= our_segments()
    ipc.discard(packed)
    assert not (names & our_segments())


def test_a_half_packed_payload_leaves_no_segment():
    """Packing fails on the second tensor (a meta tensor has no data): the first one's segment
    must not stay in /dev/shm, since no reader will ever see it."""
    before = our_segments()
    with pytest.raises((NotImplementedError, RuntimeError)):
        ipc.Packer(os.getpid(), 3).pack(
            {"ok": torch.zeros(2_000_000, dtype=torch.uint8), "bad": torch.empty(4, device="meta")}
        )
    assert our_segments() == before


def test_a_half_packed_payload_gives_its_pool_slot_back():
    packer = ipc.Packer(os.getpid(), 5, pool_slots=1)
    try:
        with pytest.raises((NotImplementedError, RuntimeError)):
            packer.pack({"ok": torch.zeros(2_000_000, dtype=torch.uint8), "bad": torch.empty(4, device="meta")})
        # The only slot is free again: the next large tensor goes to it, not to a one-shot segment.
        packed = packer.pack(torch.ones(2_000_000, dtype=torch.uint8))
        assert packed.pooled
        assert torch.equal(ipc.unpack(packed), torch.ones(2_000_000, dtype=torch.uint8))
    finally:
        packer.close()


def test_rows_of_a_batch_go_to_reusable_slots_with_their_own_bytes():
    """The 256²/batch-4 shape: each row is under the threshold, the batch storage above it, so
    each row goes to a slot of its own, holding that row's bytes and nothing else."""
    batch = torch.arange(4 * 600_000, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, 600_000)
    packer = ipc.Packer(os.getpid(), 6, pool_slots=4)
    try:
        packed = packer.pack(list(batch.unbind()))
        assert all(p.pooled and p.nbytes == 600_000 for p in packed)
        assert len({p.shm_name for p in packed}) == 4
        back = ipc.unpack(packed)
        for row, got in zip(batch, back):
            assert torch.equal(got, row)
    finally:
        packer.close()


def test_copy_into_writes_exactly_its_bytes_at_the_offset_and_lets_the_mapping_close():
    import mmap

    from stagemesh.stage_service.transport.shm_pool import copy_into

    mapping = mmap.mmap(-1, 4096)
    mapping[:] = b"\xee" * 4096
    raw = torch.arange(100, dtype=torch.uint8)
    copy_into(mapping, 64, raw)
    copy_into(mapping, 0, torch.empty(0, dtype=torch.uint8))  # nothing to copy: nothing touched
    assert mapping[64:164] == bytes(range(100))
    assert mapping[:64] == b"\xee" * 64 and mapping[164:] == b"\xee" * (4096 - 164)
    mapping.close()  # raises BufferError if a view of it were still exported


def test_namedtuples_round_trip_as_namedtuples():
    import collections

    Pair = collections.namedtuple("Pair", "left right")
    original = Pair(torch.arange(5), {"x": torch.ones(2)})
    back = ipc.unpack(ipc.pack(original))
    assert type(back) is Pair and torch.equal(back.left, original.left) and torch.equal(back.right["x"], torch.ones(2))


def test_sweep_removes_one_rank_or_all_ranks_of_an_executor():
    p0 = ipc.Packer(os.getpid(), 0).pack([torch.zeros(1_000_001, dtype=torch.uint8)] * 2)
    p1 = ipc.Packer(os.getpid(), 1).pack(torch.zeros(1_000_001, dtype=torch.uint8))
    p11 = ipc.Packer(os.getpid(), 11).pack(torch.zeros(1_000_001, dtype=torch.uint8))
    assert len(our_segments()) >= 4
    assert ipc.sweep(os.getpid(), rank=1) == 1  # rank 1 only, not rank 11
    assert not (SHM / p1.shm_name).exists() and (SHM / p11.shm_name).exists()
    assert all((SHM / p.shm_name).exists() for p in p0)
    assert ipc.sweep(os.getpid()) == 3
    assert not our_segments()


def _dead_pid() -> int:
    ctx = mp.get_context("fork")
    p = ctx.Process(target=os._exit, args=(0,))
    p.start()
    p.join()
    assert p.exitcode == 0
    return p.pid


def test_sweep_orphans_removes_segments_of_dead_executors_only():
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead = [_dead_pid(), pid_max + 1]  # a reaped child; a pid that cannot exist
    assert not any(Path(f"/proc/{pid}").exists() for pid in dead)
    orphans = [ipc.Packer(pid, 0).pack(torch.zeros(1_000_001, dtype=torch.uint8)) for pid in dead]
    mine = ipc.Packer(os.getpid(), 0).pack(torch.zeros(1_000_001, dtype=torch.uint8))
    # A file in /dev/shm with our prefix but not our naming scheme is not ours to judge.
    stranger = shared_memory.SharedMemory(name=f"stagemesh-x-{os.getpid()}", create=True, size=1)
    try:
        assert ipc.sweep_orphans() >= 2
        assert not any((SHM / o.shm_name).exists() for o in orphans)
        assert (SHM / mine.shm_name).exists()
        assert (SHM / stranger.name.lstrip("/")).exists()
    finally:
        stranger.close()
        stranger.unlink()
        for o in orphans:
            ipc.unlink_segment(o.shm_name)
    assert torch.equal(ipc.unpack(mine), torch.zeros(1_000_001, dtype=torch.uint8))


def test_segment_unpacked_in_another_process_is_gone_afterwards():
    """The reader may be another process (the executor): it copies out and unlinks."""
    t = torch.randn(500_000)
    packed = ipc.pack(t)
    ctx = mp.get_context("spawn")  # fork after torch's thread pools started can deadlock
    q = ctx.Queue()
    p = ctx.Process(target=_reader, args=(packed, q), daemon=True)
    p.start()
    try:
        checksum, exists_after = q.get(timeout=60)
        p.join(30)
        still_there = (SHM / packed.shm_name).exists()
    finally:
        if p.is_alive():
            p.kill()
            p.join()
        ipc.unlink_segment(packed.shm_name)  # only matters when the assertions below fail
    assert p.exitcode == 0
    assert checksum == pytest.approx(float(t.double().sum()))
    assert not exists_after and not still_there


def _reader(packed, q) -> None:
    back = ipc.unpack(packed)
    q.put((float(back.double().sum()), (SHM / packed.shm_name).exists()))

"""Runtime-weight cache client: keys, publication, locks, validation, eviction (real processes,
real files, real flocks)."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch

from stagemesh.cache_service import evict
from stagemesh.stage_service.runtime_cache.lookup import REASONS, RuntimeCache, content_hash, layout_key
from stagemesh.weight_store import locks
from stagemesh.weight_store.store import CacheStore
from tests.support.runtime_cache_proc import Child, weights

KEY = "c" * 64
KEY2 = "d" * 64
KEY3 = "e" * 64


def key_of(**overrides) -> str:
    fields = dict(
        model_identity="embedded-dit",
        dtype="bf16",
        loader_version="3",
        tp_size=2,
        tp_rank=0,
        content_hash=content_hash(weights()),
    )
    fields.update(overrides)
    return layout_key(**fields)


def mapped_paths(pid: int) -> set[str]:
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split(None, 5)[5] for line in lines if len(line.split(None, 5)) == 6}


def shards(root: Path, key: str) -> list[Path]:
    return sorted((root / "v1" / key).glob("*.safetensors"))


def assert_nothing_written(root: Path) -> None:
    assert list((root / "v1").iterdir()) == [] and list((root / ".tmp").iterdir()) == []


# --- keys -----------------------------------------------------------------------------------------


def test_layout_key_inputs():
    base = key_of()
    assert len(base) == 64 and base == key_of()
    assert key_of(tp_rank=1) != base  # TP ranks get distinct entries
    assert key_of(tp_size=4) != base and key_of(dtype="f32") != base and key_of(loader_version="4") != base
    # The stream dtype (FP8 DLO streaming) separates keys; left empty, keys are as before.
    assert key_of(stream_dtype="float8_e4m3fn") != base and key_of(stream_dtype="") == base
    changed = weights()
    changed["norm.bias"].view(torch.uint8)[0] ^= 1  # one changed byte of final content
    assert content_hash(changed) != content_hash(weights())
    assert key_of(content_hash=content_hash(changed)) != base
    renamed = {("x" + n): t for n, t in weights().items()}
    assert content_hash(renamed) != content_hash(weights())
    # Each tensor's bytes are hashed on their own (side by side): the digest stays bound to its
    # name, so two same-shaped tensors trading contents give a new hash.
    pair = {"a": torch.zeros(64), "b": torch.ones(64)}
    assert content_hash({"a": pair["b"], "b": pair["a"]}) != content_hash(pair)
    with pytest.raises(ValueError):
        key_of(tp_rank=2)
    with pytest.raises(ValueError):
        key_of(content_hash="../" + "0" * 61)


def test_reason_codes_are_the_contract():
    assert REASONS == (
        "hit",
        "published",
        "lock_timeout",
        "unsupported_tensor",
        "insufficient_disk",
        "bad_manifest",
        "io_error",
    )


# --- publication ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_two_processes_publish_concurrently_one_entry_both_map_it(tmp_path):
    root = tmp_path / "cache"
    first = Child("publish", str(root), KEY, "--block-in-produce")
    second = None
    try:
        first.expect("producing")  # holds the publication lock now
        second = Child("publish", str(root), KEY)
        second.expect("started")
        first.proceed()
        outcomes = [first.expect("outcome"), second.expect("outcome")]
        assert [o["reason"] for o in outcomes] == ["published", "hit"]  # the second waited, then mapped
        assert all(o["equal"] for o in outcomes)
        assert [p.name for p in (root / "v1").iterdir()] == [KEY]
        files = {str(p) for p in shards(root, KEY)}
        for child in (first, second):
            assert files <= mapped_paths(child.pid)  # both map the one published copy
        (info,) = CacheStore(root).list_entries()
        assert info.valid and info.live_consumers == 2
        assert first.finish() == 0 and second.finish() == 0
        assert CacheStore(root).list_entries()[0].live_consumers == 0
    finally:
        first.kill()
        if second is not None:
            second.kill()


@pytest.mark.timeout(60)
def test_publisher_killed_mid_publication_releases_lock_and_next_one_cleans_up(tmp_path):
    root = tmp_path / "cache"
    victim = Child("publish", str(root), KEY, "--block-in-produce")
    try:
        victim.expect("producing")
        assert locks.try_lock(locks.lock_path(root, KEY, locks.PUBLISH_SUFFIX)) is None
        # What a publisher killed while writing leaves: a temp dir with a truncated shard.
        stale = root / ".tmp" / f"{KEY}.999999.{'0' * 32}"
        stale.mkdir()
        (stale / "model-00001-of-00001.safetensors").write_bytes(b'\x10\0\0\0\0\0\0\0{"x":')
        victim.proc.kill()
        victim.proc.wait()
        assert RuntimeCache(root).lookup(KEY).reason == "miss"  # nothing partial is visible
        again = locks.acquire(locks.lock_path(root, KEY, locks.PUBLISH_SUFFIX), 10.0)
        assert again is not None  # the kernel dropped the dead process's flock
        again.release()
        outcome = RuntimeCache(root, lock_timeout_s=10).get_or_publish(KEY, weights)
        assert outcome.reason == "published", outcome.detail
        assert list((root / ".tmp").iterdir()) == []
        assert CacheStore(root).entry_problems(KEY) == []
        outcome.entry.close()
    finally:
        victim.kill()


def test_flipped_byte_is_rebuilt_under_the_lock_never_consumed(tmp_path):
    cache = RuntimeCache(tmp_path / "cache")
    first = cache.get_or_publish(KEY, weights)
    assert first.reason == "published"
    first.entry.close()
    (shard,) = shards(cache.root, KEY)
    old_inode = shard.stat().st_ino
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    looked = cache.lookup(KEY)
    assert looked.entry is None and looked.reason == "bad_manifest" and "sha256" in looked.detail
    with open(shard, "rb"):  # keeps the old inode allocated, so its number cannot be reused
        rebuilt = cache.get_or_publish(KEY, weights)
        assert rebuilt.reason == "published", rebuilt.detail
        (new_shard,) = shards(cache.root, KEY)
        assert new_shard.stat().st_ino != old_inode
    assert all(torch.equal(rebuilt.entry.tensors[n], t) for n, t in weights().items())
    rebuilt.entry.close()


@pytest.mark.timeout(60)
def test_lock_held_elsewhere_gives_lock_timeout(tmp_path):
    root = tmp_path / "cache"
    CacheStore(root).ensure_root()
    holder = Child("hold-lock", str(root), KEY)
    try:
        holder.expect("locked")
        called = []
        started = time.monotonic()
        outcome = RuntimeCache(root, lock_timeout_s=0.3).get_or_publish(KEY, lambda: called.append(1) or weights())
        assert outcome.reason == "lock_timeout" and outcome.entry is None and not called
        assert time.monotonic() - started < 5
        assert "local flock" in outcome.detail
    finally:
        holder.kill()


def test_insufficient_disk_falls_back_and_writes_nothing(tmp_path):
    root = tmp_path / "cache"
    free = shutil.disk_usage(tmp_path).free
    outcome = RuntimeCache(root, reserve_bytes=free + 1).get_or_publish(KEY, weights)
    assert outcome.reason == "insufficient_disk" and outcome.entry is None
    assert_nothing_written(root)


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda w: {**w, "alias": w["blocks.0.weight"].view(64, 64)}, "shares its storage"),
        (lambda w: {**w, "blocks.0.weight": w["blocks.0.weight"].t()}, "non-contiguous"),
        (lambda w: {**w, "norm.bias": torch.zeros(128)[:64]}, "larger storage"),
    ],
)
def test_unsupported_tensors_fail_closed(tmp_path, make, why):
    root = tmp_path / "cache"
    outcome = RuntimeCache(root).get_or_publish(KEY, lambda: make(weights()))
    assert outcome.reason == "unsupported_tensor" and why in outcome.detail and outcome.entry is None
    assert_nothing_written(root)


def test_service_down_falls_back_to_local_flock(tmp_path):
    outcome = RuntimeCache(tmp_path / "cache", service_address="127.0.0.1:1").get_or_publish(KEY, weights)
    assert outcome.reason == "published" and "local flock (cache service unreachable" in outcome.detail
    outcome.entry.close()


def test_root_is_private_and_bad_keys_are_refused(tmp_path):
    root = tmp_path / "a" / "cache"
    cache = RuntimeCache(root)
    outcome = cache.get_or_publish("../" + "a" * 61, weights)
    assert outcome.reason == "io_error" and "key" in outcome.detail
    assert cache.lookup("A" * 64).reason == "io_error"
    assert not (tmp_path / "a").exists()  # a refused key touches nothing
    assert cache.lookup(KEY).reason == "miss"
    for directory in (tmp_path / "a", root, root / "v1", root / ".tmp", root / "locks"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    (root / "locks" / f"{KEY}.lock").symlink_to(tmp_path / "elsewhere")
    assert cache.get_or_publish(KEY, weights).reason == "io_error"  # lock files never follow links
    assert not (tmp_path / "elsewhere").exists()


# --- eviction -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_eviction_skips_entries_a_live_consumer_maps(tmp_path):
    root = tmp_path / "cache"
    cache = RuntimeCache(root)
    for key in (KEY, KEY2):
        cache.get_or_publish(key, weights).entry.close()
    consumer = Child("lookup", str(root), KEY)
    try:
        assert consumer.expect("outcome")["reason"] == "hit"
        store = CacheStore(root)
        assert {e.key: e.live_consumers for e in store.list_entries()} == {KEY: 1, KEY2: 0}
        by_key = evict.evict_keys(store, [KEY])
        assert by_key.evicted == [] and by_key.skipped_in_use == [KEY]
        by_budget = evict.evict_to_budget(store, 0)
        assert by_budget.evicted == [KEY2] and by_budget.skipped_in_use == [KEY] and by_budget.freed_bytes > 0
        assert consumer.finish() == 0
        assert evict.evict_keys(store, [KEY]).evicted == [KEY]  # a finished consumer holds nothing
        assert store.list_entries() == []
    finally:
        consumer.kill()


def test_budget_eviction_is_least_recently_used_first(tmp_path):
    cache = RuntimeCache(tmp_path / "cache")
    for key in (KEY, KEY2, KEY3):
        cache.get_or_publish(key, weights).entry.close()
    store = CacheStore(cache.root)
    for when, key in ((3_000_000, KEY), (1_000_000, KEY2), (2_000_000, KEY3)):
        os.utime(store.entry_dir(key) / "last_use", (when, when))
        os.utime(store.entry_dir(key), (when, when))
    size = {e.key: e.size_bytes for e in store.list_entries()}  # manifests differ by a few bytes
    result = evict.evict_to_budget(store, size[KEY] + size[KEY3])
    assert result.evicted == [KEY2] and result.remaining_bytes == size[KEY] + size[KEY3]
    hit = cache.lookup(KEY3)  # use refreshes the order
    hit.entry.close()
    assert evict.evict_to_budget(store, size[KEY3]).evicted == [KEY]

"""Eviction: by key, or least recently used first down to a byte budget.

An entry is removed only while this process holds both its publication lock (nobody is
publishing or rebuilding it) and its consumer lock exclusively (nobody maps it); both are tried
without blocking, and an entry that cannot be locked is skipped, never waited for.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field

from stagemesh.weight_store import locks
from stagemesh.weight_store.store import CacheStore, EntryInfo


@dataclass
class EvictResult:
    evicted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    skipped_in_use: list[str] = field(default_factory=list)
    remaining_bytes: int = 0


def evict_keys(store: CacheStore, keys: list[str]) -> EvictResult:
    for index, key in enumerate(keys):
        locks.require_key(key, f"keys[{index}]")
    by_key = {e.key: e for e in store.list_entries()}
    result = EvictResult()
    for key in keys:
        entry = by_key.get(key)
        if entry is not None:
            _evict_one(store, entry, result)
    result.remaining_bytes = sum(e.size_bytes for k, e in by_key.items() if k not in result.evicted)
    return result


def evict_to_budget(store: CacheStore, budget_bytes: int) -> EvictResult:
    """Evict until the entries total at most `budget_bytes`: invalid entries first, then the
    least recently used. Entries in use are skipped, so the total may stay above the budget."""
    entries = store.list_entries()
    total = sum(e.size_bytes for e in entries)
    result = EvictResult()
    for entry in sorted(entries, key=lambda e: (e.valid, e.last_used_unix, e.key)):
        if total <= budget_bytes:
            break
        if _evict_one(store, entry, result):
            total -= entry.size_bytes
    result.remaining_bytes = total
    return result


def _evict_one(store: CacheStore, entry: EntryInfo, result: EvictResult) -> bool:
    if not locks.is_valid_key(entry.key):
        return False  # a stray directory name is not ours to delete through a lock path
    publishing = locks.try_lock(locks.lock_path(store.root, entry.key, locks.PUBLISH_SUFFIX))
    if publishing is None:
        result.skipped_in_use.append(entry.key)
        return False
    with publishing:
        consumers = locks.try_lock(locks.lock_path(store.root, entry.key, locks.CONSUMER_SUFFIX))
        if consumers is None:
            result.skipped_in_use.append(entry.key)
            return False
        with consumers:
            store.temp_root.mkdir(mode=0o700, exist_ok=True)
            doomed = store.temp_root / f"{entry.key}.{os.getpid()}.{uuid.uuid4().hex}.evict"
            try:
                os.rename(store.entry_dir(entry.key), doomed)
            except FileNotFoundError:
                return False  # already gone
    shutil.rmtree(doomed, ignore_errors=True)
    result.evicted.append(entry.key)
    result.freed_bytes += entry.size_bytes
    return True

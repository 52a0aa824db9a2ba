"""Runtime-weight cache, client side: layout keys, lookup and publication of final weights.

One process publishes the final weights of a layout once; every engine with the same layout maps
the same files. Publication is serialized by the key's publication lock, held through the cache
service's PublishSession when it answers, else taken on the directory directly (the same flock,
so both paths exclude each other). Nothing here raises for cache reasons: every outcome is a
`CacheOutcome` with a reason code, and the caller keeps its private tensors on any failure.
See docs/DLO.md "Runtime-weight cache" for the on-disk layout and the lock protocol.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stagemesh.core import logs
from stagemesh.stage_service.runtime_cache.lease import (
    LeaseTimeout,
    PublishLease,
    ServiceUnreachable,
)
from stagemesh.weight_store import checkpoint, locks, publish
from stagemesh.weight_store.manifest import Manifest, hash_side_by_side
from stagemesh.weight_store.store import LAST_USE_FILE, MANIFEST_FILE, CacheStore

REASONS = ("hit", "published", "lock_timeout", "unsupported_tensor", "insufficient_disk", "bad_manifest", "io_error")
MISS = "miss"  # lookup only: no entry for the key

log = logs.get_logger("stagemesh.stage_service.runtime_cache.lookup")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def layout_key(
    *,
    model_identity: str,
    dtype: str,
    loader_version: str,
    tp_size: int,
    tp_rank: int,
    content_hash: str,
    schema: int = 1,
    stream_dtype: str = "",
) -> str:
    """SHA-256 over a canonical JSON of the layout. The DP rank is deliberately not an input:
    DP replicas hold identical weights and share one entry; TP ranks hold different ones.
    `stream_dtype`: how the entry's streamed weights are stored when not as the model's dtype
    (e.g. FP8 DLO streaming); left out of the document when empty, so those keys are unchanged."""
    if not (isinstance(tp_size, int) and isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank!r} tp_size={tp_size!r}")
    if not _HEX64.fullmatch(content_hash or ""):
        raise ValueError("content_hash must be 64 lowercase hex characters")
    for name, value in (("model_identity", model_identity), ("dtype", dtype), ("loader_version", loader_version)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string")
    doc = {
        "schema": schema,
        "model_identity": model_identity,
        "dtype": dtype,
        "loader_version": loader_version,
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "content_hash": content_hash,
    }
    if stream_dtype:
        doc["stream_dtype"] = stream_dtype
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _bytes_digest(t: torch.Tensor) -> tuple[int, bytes]:
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return flat.numel(), hashlib.sha256(flat.numpy().data if flat.numel() else b"").digest()


def content_hash(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over, in sorted name order, each tensor's name, dtype and shape (length-prefixed,
    so no two different dicts can produce the same byte stream), byte count and the SHA-256 of
    its bytes. The tensors' own digests are computed side by side (the publisher's start hashes
    the whole model)."""
    names = sorted(tensors)
    digests = hash_side_by_side(lambda name: _bytes_digest(tensors[name]), names)
    digest = hashlib.sha256()
    for name, (nbytes, inner) in zip(names, digests):
        t = tensors[name]
        meta = json.dumps(
            {"name": name, "dtype": str(t.dtype), "shape": list(t.shape)}, sort_keys=True, separators=(",", ":")
        ).encode()
        digest.update(len(meta).to_bytes(8, "little") + meta)
        digest.update(nbytes.to_bytes(8, "little") + inner)
    return digest.hexdigest()


@dataclass
class MappedEntry:
    """Tensors viewing the entry's files through a read-only shared mapping (the page cache every
    consumer shares). While open, the shared consumer lock keeps eviction away."""

    key: str
    tensors: dict[str, torch.Tensor]
    path: Path | None = None
    _lock: locks.FileLock | None = field(default=None, repr=False)

    def close(self) -> None:
        """Release the consumer lock. Drop the tensors too before relying on the pages going away."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None


@dataclass
class CacheOutcome:
    entry: MappedEntry | None
    reason: str
    detail: str = ""


class RuntimeCache:
    def __init__(
        self,
        root: Path,
        service_address: str | None = None,
        lock_timeout_s: float = 600.0,
        reserve_bytes: int | None = None,
    ):
        if not math.isfinite(lock_timeout_s) or lock_timeout_s <= 0:
            raise ValueError("lock_timeout_s must be a positive finite number")
        self.store = CacheStore(Path(root))
        self.service_address = service_address
        self.lock_timeout_s = lock_timeout_s
        self.reserve_bytes = reserve_bytes
        self.shard_max_bytes = publish.SHARD_MAX_BYTES

    @property
    def root(self) -> Path:
        return self.store.root

    def lookup(self, key: str) -> CacheOutcome:
        """Map a valid entry ("hit"); no entry → "miss"; an invalid one → "bad_manifest"."""
        try:
            locks.require_key(key)
            self.store.ensure_root()
            return self._map_if_valid(key, absent=MISS)
        except Exception as exc:  # noqa: BLE001 - the cache never fails its caller
            return _io_error(key, exc)

    def get_or_publish(self, key: str, produce: Callable[[], dict[str, torch.Tensor]]) -> CacheOutcome:
        try:
            locks.require_key(key)
            self.store.ensure_root()
            lease, release, how = self._publication_lock(key)
        except Exception as exc:  # noqa: BLE001 - the cache never fails its caller
            return _io_error(key, exc)
        if lease is None:
            return _outcome(
                key, CacheOutcome(None, "lock_timeout", f"{how}: not granted within {self.lock_timeout_s:g} s")
            )
        published = False
        try:
            outcome = self._under_lock(key, produce, getattr(lease, "check_held", None))
            published = outcome.reason == "published"
            outcome.detail = f"{how}; {outcome.detail}" if outcome.detail else how
            return _outcome(key, outcome)
        except Exception as exc:  # noqa: BLE001 - includes produce() raising
            return _io_error(key, exc, how)
        finally:
            _release_quietly(key, release, published)

    def _publication_lock(self, key: str):
        """(lease, release(published), how); lease None on timeout."""
        if self.service_address:
            try:
                lease = PublishLease.open(self.service_address, key, self.lock_timeout_s)
                return lease, lease.release, f"lock via cache service {self.service_address}"
            except LeaseTimeout:
                return None, None, f"lock via cache service {self.service_address}"
            except ServiceUnreachable as exc:
                how = f"local flock (cache service unreachable: {exc})"
        else:
            how = "local flock (no cache service configured)"
        held = locks.publication_lock(self.root, key, self.lock_timeout_s)
        if held is None:
            return None, None, how
        return held, lambda _published: held.release(), how

    def _under_lock(
        self, key: str, produce: Callable[[], dict[str, torch.Tensor]], still_held: Callable[[], None] | None = None
    ) -> CacheOutcome:
        """`still_held` raises if the publication lock was lost meanwhile (a lease whose cache
        service died); it runs right before the entry would appear."""
        existing = self._map_if_valid(key, absent=MISS)
        if existing.reason == "hit":
            return existing
        if existing.reason == "bad_manifest":
            log.warning("runtime cache entry invalid, rebuilding", key=key, problems=existing.detail)
            publish.discard_entry(self.store, key)  # under the lock: nobody publishes meanwhile
        publish.remove_stale_temps(self.store, key)
        tensors = produce()
        try:
            publish.check_supported(tensors)
        except publish.UnsupportedTensors as exc:
            return CacheOutcome(None, "unsupported_tensor", str(exc))
        size = publish.entry_bytes(tensors)
        needed, free = publish.required_free_bytes(self.store, size, self.reserve_bytes)
        if free < needed:
            return CacheOutcome(None, "insufficient_disk", f"need {needed} bytes free (entry {size}), have {free}")
        temp = self.store.new_temp_dir_path(key)
        temp.mkdir(mode=0o700, parents=True)
        try:
            publish.write_entry(self.store, key, tensors, temp, self.shard_max_bytes, before_commit=still_held)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        # The manifest's hashes were taken from these very files a moment ago under this lock:
        # sizes and headers are checked again, the 23.7 GB (FLUX-sized) are not hashed twice.
        mapped = self._map_if_valid(key, absent=MISS, deep=False)
        if mapped.reason != "hit":
            return CacheOutcome(None, "io_error", f"entry unreadable right after publication: {mapped.detail}")
        return CacheOutcome(mapped.entry, "published", mapped.detail)

    def _map_if_valid(self, key: str, *, absent: str, deep: bool = True) -> CacheOutcome:
        consumer = locks.consumer_lock(self.root, key)
        if consumer is None:
            return CacheOutcome(None, absent, "entry is being evicted")
        try:
            problems = self.store.entry_problems(key, deep=deep)
            if problems is None:
                consumer.release()
                return CacheOutcome(None, absent)
            if problems:
                consumer.release()
                return CacheOutcome(None, "bad_manifest", "; ".join(problems[:5]))
            directory = self.store.entry_dir(key)
            tensors = _map_entry(directory)
        except BaseException:
            consumer.release()
            raise
        _touch(directory / LAST_USE_FILE)
        return CacheOutcome(MappedEntry(key, tensors, directory, consumer), "hit")


def _map_entry(directory: Path) -> dict[str, torch.Tensor]:
    manifest = Manifest.from_json((directory / MANIFEST_FILE).read_bytes())
    tensors: dict[str, torch.Tensor] = {}
    for file_name in sorted(manifest.files):
        for name, tensor in checkpoint.map_tensors(directory / file_name).items():
            if name in manifest.tensors:
                tensors[name] = tensor
    if set(tensors) != set(manifest.tensors):
        raise ValueError(f"{directory}: shards do not hold every tensor of the manifest")
    return tensors


def _release_quietly(key: str, release: Callable[[bool], None], published: bool) -> None:
    try:
        release(published)
    except Exception as exc:  # noqa: BLE001 - a lock we cannot release cleanly dies with its holder
        log.warning("runtime cache lock release failed", key=key, error=f"{type(exc).__name__}: {exc}")


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # last use is advisory (LRU order); a read-only root still serves hits


def _io_error(key: str, exc: BaseException, how: str = "") -> CacheOutcome:
    detail = f"{type(exc).__name__}: {exc}"
    return _outcome(key, CacheOutcome(None, "io_error", f"{how}; {detail}" if how else detail))


def _outcome(key: str, outcome: CacheOutcome) -> CacheOutcome:
    report = log.info if outcome.reason in ("hit", "published", MISS) else log.warning
    report("runtime cache", key=key, reason=outcome.reason, detail=outcome.detail)
    return outcome

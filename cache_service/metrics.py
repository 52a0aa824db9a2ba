"""The cache service's own Prometheus readings: entries, bytes, consumers, evictions.

Readers run on the metrics HTTP server's thread at scrape time and only read plain attributes
of the domain objects.
"""

from __future__ import annotations

from typing import Protocol

from stagemesh.core.metrics import Reader, Reading
from stagemesh.weight_store.store import CacheStore


class EvictionCounts(Protocol):
    evicted_entries: int
    evicted_bytes: int


def cache_readings(store: CacheStore, servicer: EvictionCounts) -> Reader:
    """The store is scanned at each scrape; the eviction counts are the servicer's."""

    def read() -> list[Reading]:
        entries = store.list_entries()
        return [
            Reading("stagemesh_cache_entries", "entries in the runtime-weight cache", len(entries)),
            Reading("stagemesh_cache_bytes", "bytes on disk of all entries", sum(e.size_bytes for e in entries)),
            Reading(
                "stagemesh_cache_live_consumers",
                "processes mapping an entry now",
                sum(e.live_consumers for e in entries),
            ),
            Reading(
                "stagemesh_cache_evictions",
                "entries evicted since the service started",
                servicer.evicted_entries,
                counter=True,
            ),
            Reading(
                "stagemesh_cache_evicted_bytes",
                "bytes freed by evictions since the service started",
                servicer.evicted_bytes,
                counter=True,
            ),
        ]

    return read

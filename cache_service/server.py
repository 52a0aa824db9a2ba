"""gRPC face of the cache service: a thin servicer over CacheStore, and the process entry."""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

from stagemesh.cache_service import evict
from stagemesh.cache_service.metrics import cache_readings
from stagemesh.core import auth, errors, logs, metrics, tls
from stagemesh.core import serve as lifecycle
from stagemesh.core.rpc import ServiceHost, servicer_method
from stagemesh.v1 import cache_pb2, cache_pb2_grpc
from stagemesh.weight_store import locks
from stagemesh.weight_store.store import CacheStore, EntryInfo, StoreStats, default_root

_SERVICE = cache_pb2.DESCRIPTOR.services_by_name["CacheService"]
SERVICE_NAME = _SERVICE.full_name
# With a token, every CacheService call needs it: the reads too, which name the cache root's path
# and the keys of the models a node serves. The stages' workers send it when they publish.
PROTECTED_METHODS = auth.every_method(_SERVICE)

log = logs.get_logger("stagemesh.cache_service.server")

DEFAULT_LOCK_TIMEOUT_S = 600.0

LOCK_POLL_MIN_S = 0.005  # waiting for a publication lock: first pause between tries, then doubling
LOCK_POLL_MAX_S = 0.05


def entry_to_proto(entry: EntryInfo) -> cache_pb2.CacheEntry:
    return cache_pb2.CacheEntry(
        key=entry.key,
        size_bytes=entry.size_bytes,
        file_count=entry.file_count,
        tensor_count=entry.tensor_count,
        last_used_unix=entry.last_used_unix,
        live_consumers=entry.live_consumers,
        valid=entry.valid,
    )


def stats_to_proto(stats: StoreStats) -> cache_pb2.GetStatsResponse:
    return cache_pb2.GetStatsResponse(
        root=stats.root,
        entry_count=stats.entry_count,
        total_bytes=stats.total_bytes,
        invalid_entry_count=stats.invalid_entry_count,
        stale_temp_dirs=stats.stale_temp_dirs,
    )


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    """With a token, the auth interceptor (PROTECTED_METHODS) checks it before any call reaches
    this class."""

    def __init__(self, store: CacheStore, *, max_bytes: int | None = None):
        self.store = store
        self.max_bytes = max_bytes
        self.evicted_entries = 0  # since start, for the metrics
        self.evicted_bytes = 0

    def _count(self, result: evict.EvictResult) -> evict.EvictResult:
        self.evicted_entries += len(result.evicted)
        self.evicted_bytes += result.freed_bytes
        return result

    @servicer_method
    async def ListEntries(self, request, context):
        # Directory scans touch the disk: keep them off the event loop.
        entries = await asyncio.to_thread(self.store.list_entries)
        return cache_pb2.ListEntriesResponse(entries=[entry_to_proto(e) for e in entries])

    @servicer_method
    async def GetStats(self, request, context):
        stats = await asyncio.to_thread(self.store.stats)
        return stats_to_proto(stats)

    @servicer_method
    async def Evict(self, request, context):
        target = request.WhichOneof("target")
        if target == "key":
            key = locks.require_key(request.key, "key")
            result = self._count(await asyncio.to_thread(evict.evict_keys, self.store, [key]))
        elif target == "budget_bytes":
            if request.budget_bytes < 0:
                raise errors.InvalidArgument.field("budget_bytes", "must be >= 0")
            result = self._count(await asyncio.to_thread(evict.evict_to_budget, self.store, request.budget_bytes))
        else:
            raise errors.InvalidArgument.field("target", "set key or budget_bytes")
        log.info("evicted", keys=result.evicted, freed_bytes=result.freed_bytes, skipped=result.skipped_in_use)
        return evict_to_proto(result)

    @servicer_method
    async def PublishSession(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return  # the client went away before naming a key
        key = locks.require_key(first.key, "key")
        timeout_s = first.lock_timeout_seconds or DEFAULT_LOCK_TIMEOUT_S
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise errors.InvalidArgument.field("lock_timeout_seconds", "must be a positive finite number")
        held = await _acquire_publication_lock(self.store.root, key, timeout_s)
        if held is None:
            raise errors.DeadlineExceeded(f"publication lock of {key} not granted within {timeout_s:g} s")
        published = False
        try:
            problems = await asyncio.to_thread(self.store.entry_problems, key, deep=False)
            log.info("publication lock granted", key=key, existing=problems is not None)
            yield cache_pb2.PublishSessionResponse(granted=True, existing_valid=problems == [])
            # Hold the lock until the client says done, half-closes, cancels or dies.
            async for message in request_iterator:
                if message.done:
                    published = message.published
                    break
        finally:
            held.release()
            log.info("publication lock released", key=key, published=published)
        if published and self.max_bytes is not None:
            result = self._count(await asyncio.to_thread(evict.evict_to_budget, self.store, self.max_bytes))
            log.info(
                "budget enforced",
                max_bytes=self.max_bytes,
                evicted=result.evicted,
                remaining_bytes=result.remaining_bytes,
            )


async def _acquire_publication_lock(root: Path, key: str, timeout_s: float) -> locks.FileLock | None:
    """Poll the key's flock without blocking from the event loop: a waiter holds no thread, so
    any number of sessions waiting on one key cannot starve a publication of another. A
    cancelled session stops between polls and never ends up holding the lock."""
    loop = asyncio.get_running_loop()
    path = locks.lock_path(root, key, locks.PUBLISH_SUFFIX)
    deadline = loop.time() + timeout_s
    pause = LOCK_POLL_MIN_S
    while (held := locks.try_lock(path)) is None:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return None
        await asyncio.sleep(min(pause, remaining))
        pause = min(pause * 2, LOCK_POLL_MAX_S)
    return held


def evict_to_proto(result: evict.EvictResult) -> cache_pb2.EvictResponse:
    return cache_pb2.EvictResponse(
        evicted_keys=result.evicted,
        freed_bytes=result.freed_bytes,
        skipped_in_use_keys=result.skipped_in_use,
        remaining_bytes=result.remaining_bytes,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: %(default)s)")
    parser.add_argument(
        "--root",
        type=_root_path,
        default=default_root(),
        help="runtime-weight cache root; created 0700 if missing (default: %(default)s)",
    )
    parser.add_argument(
        "--max-bytes",
        type=_byte_count,
        default=None,
        help="byte budget of the cache; after each publication least recently used entries that "
        "nobody maps are evicted down to it (default: no budget)",
    )
    tls.add_arguments(parser, client=False)  # the cache service calls no other service
    auth.add_arguments(parser, "all cache calls")  # health and reflection stay open
    metrics.add_argument(parser)
    parser.add_argument(
        "--ready-file",
        default=None,
        help="write {address, pid} (and metrics with a metrics port) as JSON here once listening, for supervisors "
        "of port-0 services",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=logs.LOG_LEVELS,
        help="log level (default: %(default)s)",
    )


def _root_path(text: str) -> Path:
    # Expanded while parsing, so the async serve() does no home-directory lookup.
    return Path(text).expanduser()


def _byte_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


async def serve(args: argparse.Namespace) -> None:
    store = CacheStore(args.root)
    token = auth.load_token(getattr(args, "token_file", None))
    service_metrics = metrics.ServiceMetrics("cache", args.host, getattr(args, "metrics_port", None))
    # Metrics first: they also count the calls the auth interceptor refuses.
    interceptors = [*service_metrics.interceptors(), *auth.interceptors(token, PROTECTED_METHODS)]
    host = ServiceHost(
        args.host,
        args.port,
        [SERVICE_NAME],
        interceptors=interceptors,
        credentials=tls.server_credentials(getattr(args, "tls_cert", None), getattr(args, "tls_key", None)),
        health_port=getattr(args, "health_port", None),
    )
    servicer = CacheServicer(store, max_bytes=getattr(args, "max_bytes", None))
    cache_pb2_grpc.add_CacheServiceServicer_to_server(servicer, host.server)
    service_metrics.add_readings(cache_readings(store, servicer))

    async def load() -> None:
        await asyncio.to_thread(store.ensure_root)
        log.info("cache root ready", root=str(store.root))

    await lifecycle.run(host, ready_file=args.ready_file, load=load, metrics=service_metrics)


def main(args: argparse.Namespace) -> None:
    logs.configure("cache", args.log_level)
    lifecycle.main("cache service", serve(args))

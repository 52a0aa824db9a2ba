"""gRPC face of the cache service: a thin servicer over CacheStore, and the process entry."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from cache_service.store import CacheStore, EntryInfo, StoreStats, default_root
from stagemesh import logs, serve as lifecycle
from stagemesh.rpc import ServiceHost, servicer_method
from stagemesh.v1 import cache_pb2, cache_pb2_grpc

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name

log = logs.get_logger("cache_service.server")


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
    def __init__(self, store: CacheStore):
        self.store = store

    @servicer_method
    async def ListEntries(self, request, context):
        # Directory scans touch the disk: keep them off the event loop.
        entries = await asyncio.to_thread(self.store.list_entries)
        return cache_pb2.ListEntriesResponse(entries=[entry_to_proto(e) for e in entries])

    @servicer_method
    async def GetStats(self, request, context):
        stats = await asyncio.to_thread(self.store.stats)
        return stats_to_proto(stats)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: %(default)s)")
    parser.add_argument(
        "--root",
        type=Path,
        default=default_root(),
        help="runtime-weight cache root; created if missing (default: %(default)s)",
    )
    parser.add_argument(
        "--ready-file",
        default=None,
        help="write {address, pid} as JSON here once listening, for supervisors of port-0 services",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default: %(default)s)",
    )


async def serve(args: argparse.Namespace) -> None:
    store = CacheStore(Path(args.root))
    host = ServiceHost(args.host, args.port, [SERVICE_NAME])
    cache_pb2_grpc.add_CacheServiceServicer_to_server(CacheServicer(store), host.server)

    async def load() -> None:
        await asyncio.to_thread(store.ensure_root)
        log.info("cache root ready", root=str(store.root))

    await lifecycle.run(host, ready_file=args.ready_file, load=load)


def main(args: argparse.Namespace) -> None:
    logs.configure("cache", args.log_level)
    lifecycle.main("cache service", serve(args))

"""Runtime cache through a real `stagemesh cache` process: PublishSession holds the publication
lock exactly as long as its stream lives; Evict, --max-bytes and key validation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from stagemesh.stage_service.runtime_cache.lookup import RuntimeCache
from stagemesh.v1 import cache_pb2, cache_pb2_grpc
from stagemesh.weight_store import locks
from stagemesh.weight_store.store import CacheStore
from tests.cache_service.test_cache_service import stop, wait_ready, wait_serving
from tests.support.runtime_cache_proc import Child, weights

REPO = Path(__file__).resolve().parents[2]
KEY = "c" * 64
KEY2 = "d" * 64


@pytest.fixture
def service(tmp_path):
    """A `stagemesh cache` process; yields (address, root, pid). `max_bytes` via indirect param."""
    procs = []

    def start(max_bytes: int | None = None) -> tuple[str, Path, int]:
        root = tmp_path / "cache"
        ready, log_path = tmp_path / "cache.ready", tmp_path / "cache.log"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        extra = ["--max-bytes", str(max_bytes)] if max_bytes is not None else []
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stagemesh",
                    "cache",
                    "--port",
                    "0",
                    "--root",
                    str(root),
                    "--ready-file",
                    str(ready),
                    *extra,
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append((proc, log_path))
        address = wait_ready(proc, ready, log_path)
        with grpc.insecure_channel(address) as channel:
            wait_serving(channel, "stagemesh.v1.CacheService")
        return address, root, proc.pid

    yield start
    for proc, log_path in procs:
        if proc.poll() is None:
            stop(proc, log_path)


def field_violations(exc: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(exc)
    bad = error_details_pb2.BadRequest()
    assert status is not None and status.details[0].Unpack(bad)
    return [v.field for v in bad.field_violations]


@pytest.mark.timeout(90)
def test_session_holds_lock_while_stream_lives_and_releases_on_sigkill(service):
    address, root, service_pid = service()
    lock_file = locks.lock_path(root, KEY, locks.PUBLISH_SUFFIX)
    publisher = Child("publish", str(root), KEY, "--service", address, "--block-in-produce")
    try:
        publisher.expect("producing")
        assert locks.try_lock(lock_file) is None  # the service holds it for the stream
        held_by = [
            line.split()[4]
            for line in Path("/proc/locks").read_text().splitlines()
            if line.split()[5].endswith(f":{lock_file.stat().st_ino}")
        ]
        assert held_by == [str(service_pid)]
        publisher.proc.kill()  # the stream dies with the client
        publisher.proc.wait()
        again = locks.acquire(lock_file, 10.0)
        assert again is not None
        again.release()
        outcome = RuntimeCache(root, service_address=address, lock_timeout_s=10).get_or_publish(KEY, weights)
        assert outcome.reason == "published" and f"lock via cache service {address}" in outcome.detail
        assert locks.try_lock(lock_file) is not None  # session ended with the call
        outcome.entry.close()
    finally:
        publisher.kill()


@pytest.mark.timeout(90)
def test_second_publisher_waits_on_the_session_then_maps(service):
    address, root, _ = service()
    first = Child("publish", str(root), KEY, "--service", address, "--block-in-produce")
    second = None
    try:
        first.expect("producing")  # its session holds the lock now
        second = Child("publish", str(root), KEY, "--service", address)
        second.expect("started")
        first.proceed()
        reasons = [c.expect("outcome")["reason"] for c in (first, second)]
        assert reasons == ["published", "hit"]
        with grpc.insecure_channel(address) as channel:
            (entry,) = cache_pb2_grpc.CacheServiceStub(channel).ListEntries(cache_pb2.ListEntriesRequest()).entries
            assert entry.key == KEY and entry.valid and entry.live_consumers == 2
    finally:
        first.kill()
        if second is not None:
            second.kill()


@pytest.mark.timeout(90)
def test_session_lock_timeout_and_bad_keys(service):
    address, root, _ = service()
    holder = Child("hold-lock", str(root), KEY)
    try:
        holder.expect("locked")
        outcome = RuntimeCache(root, service_address=address, lock_timeout_s=0.3).get_or_publish(KEY, weights)
        assert outcome.reason == "lock_timeout" and "cache service" in outcome.detail
    finally:
        holder.kill()
    with grpc.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        for bad in ("../../etc/passwd", "A" * 64, "g" * 64, ""):
            with pytest.raises(grpc.RpcError) as err:
                stub.Evict(cache_pb2.EvictRequest(key=bad), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(err.value) == ["key"]
            with pytest.raises(grpc.RpcError) as err:
                list(stub.PublishSession(iter([cache_pb2.PublishSessionRequest(key=bad)]), timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(err.value) == ["key"]
        with pytest.raises(grpc.RpcError) as err:
            stub.Evict(cache_pb2.EvictRequest(budget_bytes=-1), timeout=10)
        assert field_violations(err.value) == ["budget_bytes"]
    assert sorted(p.name for p in root.iterdir()) == [".tmp", "locks", "v1"]


@pytest.mark.timeout(90)
def test_evict_rpc_and_max_bytes_budget(service):
    address, root, _ = service(max_bytes=1)  # room for nothing that is not in use
    cache = RuntimeCache(root, service_address=address)
    first = cache.get_or_publish(KEY, weights)
    assert first.reason == "published"
    # The publisher still maps KEY, so the budget enforced at the end of its session spared it.
    assert [e.key for e in CacheStore(root).list_entries()] == [KEY]
    first.entry.close()
    second = cache.get_or_publish(KEY2, weights)
    assert second.reason == "published"
    assert [e.key for e in CacheStore(root).list_entries()] == [KEY2]  # KEY (unused, older) evicted
    with grpc.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        refused = stub.Evict(cache_pb2.EvictRequest(key=KEY2), timeout=10)
        assert list(refused.evicted_keys) == [] and list(refused.skipped_in_use_keys) == [KEY2]
        size = CacheStore(root).list_entries()[0].size_bytes
        second.entry.close()
        done = stub.Evict(cache_pb2.EvictRequest(key=KEY2), timeout=10)
        assert list(done.evicted_keys) == [KEY2] and done.freed_bytes == size and done.remaining_bytes == 0
    assert CacheStore(root).list_entries() == []

"""Cache service: the real server in a subprocess, over the on-disk store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stagemesh.core import readyfile
from stagemesh.v1 import cache_pb2, cache_pb2_grpc
from tests.support.cache_entries import KEY_A, KEY_B

REPO = Path(__file__).resolve().parents[2]


# --- the service, as a real process -----------------------------------------------------------


def start_service(tmp_path: Path, root: Path) -> tuple[subprocess.Popen, Path, Path]:
    ready = tmp_path / "cache.ready"
    log_path = tmp_path / "cache.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stagemesh.cache_service",
                "--port",
                "0",
                "--root",
                str(root),
                "--ready-file",
                str(ready),
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, ready, log_path


def wait_ready(proc: subprocess.Popen, ready: Path, log_path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = readyfile.read(ready)
        if info is not None:
            assert info["pid"] == proc.pid
            return info["address"]
        if proc.poll() is not None:
            pytest.fail(f"cache service exited with {proc.returncode}:\n{log_path.read_text()}")
        time.sleep(0.05)
    pytest.fail(f"no ready file after {timeout}s:\n{log_path.read_text()}")


def wait_serving(channel: grpc.Channel, service: str, timeout: float = 15.0) -> None:
    """Health turns SERVING only after load; watch the stream instead of polling Check."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    for update in stream:
        if update.status == health_pb2.HealthCheckResponse.SERVING:
            stream.cancel()
            return
    pytest.fail(f"{service!r} never reported SERVING")


def reflected_services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    return {s.name for s in response.list_services_response.service}


def stop(proc: subprocess.Popen, log_path: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"cache service ignored SIGTERM for 10 s:\n{log_path.read_text()}")
    assert code == 0, log_path.read_text()


@pytest.mark.timeout(90)
def test_service_lists_entries_and_stats_then_stops_on_sigterm(tmp_path, populated):
    root = populated["root"]
    proc, ready, log_path = start_service(tmp_path, root)
    try:
        address = wait_ready(proc, ready, log_path)
        with grpc.insecure_channel(address) as channel:
            wait_serving(channel, "")
            wait_serving(channel, "stagemesh.v1.CacheService")
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            listed = stub.ListEntries(cache_pb2.ListEntriesRequest(), timeout=10).entries
            expected = populated["store"].list_entries()
            assert [e.key for e in listed] == [e.key for e in expected] == sorted([KEY_A, KEY_B])
            for got, want in zip(listed, expected):
                assert (got.size_bytes, got.file_count, got.tensor_count, got.valid, got.live_consumers) == (
                    want.size_bytes,
                    want.file_count,
                    want.tensor_count,
                    want.valid,
                    0,
                )
                assert got.last_used_unix == pytest.approx(want.last_used_unix)
            assert listed[0].valid != listed[1].valid

            stats = stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert stats.root == str(root)
            assert (stats.entry_count, stats.invalid_entry_count, stats.stale_temp_dirs) == (2, 1, 2)
            assert stats.total_bytes == sum(e.size_bytes for e in expected) > 0

            services = reflected_services(channel)
            assert {"stagemesh.v1.CacheService", "grpc.health.v1.Health"} <= services
        stop(proc, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(90)
def test_service_creates_missing_root_and_serves_empty_cache(tmp_path):
    root = tmp_path / "fresh" / "cache"
    proc, ready, log_path = start_service(tmp_path, root)
    try:
        address = wait_ready(proc, ready, log_path)
        with grpc.insecure_channel(address) as channel:
            wait_serving(channel, "stagemesh.v1.CacheService")
            assert root.is_dir()
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            assert list(stub.ListEntries(cache_pb2.ListEntriesRequest(), timeout=10).entries) == []
            stats = stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            assert (stats.entry_count, stats.total_bytes, stats.stale_temp_dirs) == (0, 0, 0)
        stop(proc, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_service_with_unusable_root_exits_nonzero(tmp_path):
    root = tmp_path / "occupied"
    root.write_text("a file where the cache root should be")
    proc, _ready, log_path = start_service(tmp_path, root)
    try:
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    assert code == 1, log_text
    assert "not a directory" in log_text and "Traceback" not in log_text

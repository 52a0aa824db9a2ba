"""The runtime-weight cache against a hostile or failing neighbour, with real processes: a root
others own or can change is refused (cache service and the stage's direct path), a symlinked
locks/ is refused, shards are private, waiters on one key do not starve another key, and a
publisher whose cache service died abandons its publication."""

from __future__ import annotations

import os
import queue
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from stagemesh.v1 import cache_pb2, cache_pb2_grpc
from tests.cache_service.test_runtime_cache_service import service  # noqa: F401 - the fixture, found by name
from tests.support.cache_entries import KEY_A, populated_root
from tests.support.meshproc import REPO
from tests.support.runtime_cache_proc import Child

KEY = "c" * 64
KEY2 = "d" * 64
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _outcome(*args: str) -> dict:
    child = Child(*args)
    try:
        return child.expect("outcome")
    finally:
        child.finish()


def _planted_root(tmp_path: Path, owner: int | None, mode: int) -> Path:
    """A root holding a valid, self-consistent entry of KEY_A, then given away / opened up."""
    root = tmp_path / "planted"
    populated_root(root)
    for directory, _, files in os.walk(root):
        os.chmod(directory, mode)
        if owner is not None:
            os.chown(directory, owner, owner)
            for name in files:
                os.chown(os.path.join(directory, name), owner, owner)
    return root


def _cache_service_start(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagemesh", "cache", "--root", str(root), "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "owner,mode,needle",
    [
        pytest.param(NOBODY, 0o777, f"is owned by uid {NOBODY}", marks=as_root, id="other-uid"),
        pytest.param(None, 0o777, "has mode 0777", id="world-writable"),
        pytest.param(None, 0o750, "has mode 0750", id="group-readable"),
    ],
)
def test_a_root_others_own_or_can_change_is_refused(tmp_path, owner, mode, needle):
    root = _planted_root(tmp_path, owner, mode)
    done = _cache_service_start(root)
    assert done.returncode == 1, done.stderr
    assert needle in done.stderr and ("chown" in done.stderr or "chmod 700" in done.stderr), done.stderr
    # The stage's direct-directory path (no cache service) refuses the planted entry too.
    outcome = _outcome("lookup", str(root), KEY_A)
    assert outcome["reason"] != "hit" and needle in outcome["detail"], outcome


def test_a_symlinked_locks_directory_is_refused(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    (root / "locks").symlink_to(elsewhere)
    outcome = _outcome("publish", str(root), KEY)
    assert outcome["reason"] != "published" and "is a symlink" in outcome["detail"], outcome
    assert list(elsewhere.iterdir()) == []  # no lock file was created through the link


def test_every_published_file_is_0600(tmp_path):
    root = tmp_path / "root"
    outcome = _outcome("publish", str(root), KEY)
    assert outcome["reason"] == "published", outcome
    modes = {Path(f).name: stat.S_IMODE(os.stat(f).st_mode) for f in outcome["files"]}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o600}, modes


def _waiting_session(stub, key: str):
    requests: queue.Queue = queue.Queue()
    requests.put(cache_pb2.PublishSessionRequest(key=key, lock_timeout_seconds=120))
    return stub.PublishSession(iter(requests.get, None), timeout=180), requests


def test_many_waiters_on_one_key_do_not_starve_another_key(service):
    address, root, _ = service()
    holder = Child("publish", str(root), KEY, "--service", address, "--block-in-produce")
    holder.expect("producing")  # holds KEY's lock through its session
    waiters = []
    with grpc.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        try:
            waiters = [_waiting_session(stub, KEY) for _ in range(80)]
            outcome = _outcome("publish", str(root), KEY2, "--service", address, "--lock-timeout", "20")
            assert outcome["reason"] == "published", outcome
            assert "lock via cache service" in outcome["detail"], outcome
        finally:
            for call, requests in waiters:
                requests.put(None)
                call.cancel()
            holder.proceed()
            assert holder.expect("outcome")["reason"] == "published"
            assert holder.finish() == 0


def test_a_publisher_whose_cache_service_died_abandons_its_publication(service):
    address, root, pid = service()
    first = Child("publish", str(root), KEY, "--service", address, "--block-in-produce")
    first.expect("producing")  # the service holds KEY's lock for it
    os.kill(pid, signal.SIGKILL)  # the lock goes with the service
    second = Child("publish", str(root), KEY, "--block-in-produce")  # the local flock is free now
    second.expect("producing")
    try:
        first.proceed()
        lost = first.expect("outcome")
        assert lost["reason"] != "published" and "publication lock lost" in lost["detail"], lost
        assert not (root / "v1" / KEY).exists()
        second.proceed()
        assert second.expect("outcome")["reason"] == "published"
    finally:
        first.finish()
        second.finish()

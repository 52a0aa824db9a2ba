"""The shared-memory check every packing test runs: nothing this process owns is left behind."""

from __future__ import annotations

import os

import pytest

from stagemesh.stage_service.transport import ipc


def our_segments(pid: int | None = None) -> set[str]:
    """Segments named for executor `pid` (default: this test process)."""
    prefix = f"{ipc.SHM_PREFIX}-{os.getpid() if pid is None else pid}-"
    return {e for e in os.listdir("/dev/shm") if e.startswith(prefix)}


@pytest.fixture(autouse=True)
def no_segment_left_behind():
    # Only segments this process owns: another test session may run on the same machine.
    before = our_segments()
    yield
    leaked = our_segments() - before
    ipc.sweep(os.getpid())
    assert not leaked, f"segments left in /dev/shm: {leaked}"

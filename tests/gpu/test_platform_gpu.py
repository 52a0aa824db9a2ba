"""On a real GPU: a host tensor reaches the device without waiting for the work already queued
there (platform.to_device), so a worker can queue its next batch while the last one runs."""

from __future__ import annotations

import time

import pytest
import torch

from stage_service import platform

pytestmark = pytest.mark.gpu


def test_to_device_neither_waits_for_queued_work_nor_changes_values():
    host = torch.randn(64, 1024)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued device work (clock cycles)
    started = time.perf_counter()
    on_device = platform.to_device(host, "cuda")
    returned_s = time.perf_counter() - started
    before_sync = time.perf_counter()
    torch.cuda.synchronize()
    queued_s = time.perf_counter() - before_sync
    assert returned_s < queued_s / 4, (returned_s, queued_s)  # it did not wait for the sleep
    assert on_device.device.type == "cuda" and torch.equal(on_device.cpu(), host)

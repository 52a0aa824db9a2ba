"""On a real GPU: a host tensor reaches the device without waiting for the work already queued
there (platform.to_device), so a worker can queue its next batch while the last one runs; and a
thread waiting on a blocking event sleeps instead of spinning (the async output thread waits so
while the main thread launches)."""

from __future__ import annotations

import time

import pytest
import torch

from stagemesh.stage_service import platform

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


def test_a_blocking_event_wait_sleeps_instead_of_spinning():
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of queued device work
    event = platform.DeviceEvent("cuda", blocking=True).record()
    cpu_started, started = time.thread_time(), time.perf_counter()
    event.synchronize()
    cpu_s, waited_s = time.thread_time() - cpu_started, time.perf_counter() - started
    assert event.query() and waited_s > 0.1, waited_s
    assert cpu_s < waited_s / 10, (cpu_s, waited_s)  # a spinning wait burns about all of it

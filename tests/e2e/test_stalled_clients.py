"""Clients that open Generate for large tensor results and never read (grant no HTTP/2 flow-control
window) must not grow the gateway without bound: past max_undelivered_bytes their results are
refused with RESOURCE_EXHAUSTED instead of held, and the gateway still answers a normal call."""

from __future__ import annotations

import time

import pytest

from bench.stalled_clients import GENERATE_PATH, gateway_pid, normal_generate_ok, rss_mb, stalled_request
from tests.support.meshproc import start_mesh, write_config
from tests.support.stalled_h2 import StalledClients

pytestmark = pytest.mark.mesh

CLIENTS = 20
HELD_RESULTS = 4  # the bound below holds this many 512x512 float32 results (3 MiB each)
MAX_UNDELIVERED_BYTES = HELD_RESULTS * 3_200_000
# Before the bound each stalled call held ~16 MB; 20 of them grew the gateway by ~320 MB.
MAX_GROWTH_MB = 200


@pytest.fixture(scope="module")
def stalled_mesh(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("stalled-clients")
    config = write_config(
        root / "mesh.toml", model_dir, extra_gateway=f"max_undelivered_bytes = {MAX_UNDELIVERED_BYTES}"
    )
    mesh = start_mesh(config, root / "mesh.log")
    yield mesh
    assert mesh.stop() == 0, mesh.logs()[-3000:]


def test_results_for_clients_that_never_read_are_bounded(stalled_mesh):
    mesh = stalled_mesh
    assert normal_generate_ok(mesh)
    pid = gateway_pid(mesh)
    before = rss_mb(pid)
    stalled = StalledClients(mesh.address, GENERATE_PATH, stalled_request(512, 1), CLIENTS)
    try:
        deadline = time.monotonic() + 90
        while sum(c.ended for c in stalled.calls) < CLIENTS - HELD_RESULTS:
            assert time.monotonic() < deadline, f"refused so far: {sum(c.ended for c in stalled.calls)}"
            time.sleep(0.5)
        growth = rss_mb(pid) - before
        assert growth < MAX_GROWTH_MB, growth
        assert normal_generate_ok(mesh)
    finally:
        stalled.close()

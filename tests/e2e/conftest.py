from __future__ import annotations

import pytest

from tests.support.sleep_mesh import BIG, generate, start_sleep_mesh, stopped_cleanly


@pytest.fixture(scope="session")
def sleepy(tmp_path_factory, model_dir):
    """The mesh that Sleep, WakeUp and Pause/Resume mutate (tests/support/sleep_mesh.py), shared by
    test_fuzz, test_sleep_wake and test_sleep_wake_clients: each of them leaves every stage awake
    with generation open, and none touches the session's `mesh`. At the end one more output travels
    through shared memory, then the mesh must stop cleanly (exit 0, no segment left behind) with no
    traceback in its log."""
    mesh = start_sleep_mesh(tmp_path_factory.mktemp("sleepy"), model_dir)
    yield mesh
    with mesh.channel() as channel:
        assert generate(mesh.gateway(channel), BIG)  # right before the stop
    stopped_cleanly(mesh, mesh.pids)
    assert "Traceback" not in mesh.logs()

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.weights import ensure_model_dir
from tests.support.meshproc import Mesh, segments_of, shm_entries, start_mesh, write_config

# torch.compile on the CPU in this process and every process the tests start (inductor reads both
# when first imported, after this). The vector-ISA check builds and loads a probe library per ISA
# in every fresh compile cache, about 10 s of g++ on two shared cores each time: the CPU's own
# flags are taken instead (an ISA the compiler cannot build then fails the compile, loudly). One
# compile thread: a pool of compile workers, each importing torch, costs more than it saves here.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# The files that take 40 s or more of the suite (--junitxml times on two shared cores), longest
# first. scripts/test hands xdist the files in collection order (--no-loadscope-reorder), so these
# start first and the short files fill in around them; a long file taken last would run alone
# while the other worker idles. A file not listed keeps its place after them.
LONG_FILES_FIRST = (
    "tests/e2e/test_acceleration_mesh.py",
    "tests/e2e/test_video.py",
    "tests/stage_service/test_image_parallel.py",
    "tests/app/test_bench_families.py",
    "tests/stage_service/models/test_qwen_image_edit.py",
    "tests/stage_service/models/test_diffusers_families.py",
    "tests/stage_service/models/test_diffusers_models.py",
    "tests/e2e/test_lifecycle.py",
    "tests/client/test_client_mesh.py",
    "tests/app/test_cold_start_bench.py",
    "tests/e2e/test_adapters_mesh.py",
    "tests/stage_service/test_tensor_parallel.py",
    "tests/stage_service/models/test_acceleration_flux.py",
    "tests/e2e/test_compiled_invariance.py",
    "tests/e2e/test_faults.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: files stay whole


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("model") / "default-tiny")


@pytest.fixture(scope="session")
def tiny_model(model_dir) -> Path:
    """The embedded default model written into `model_dir` (once; read-only for tests)."""
    return ensure_model_dir(Path(model_dir), PipelineConfig.tiny())


@pytest.fixture(scope="session")
def random_tiny_model(tmp_path_factory) -> Path:
    """The tiny configuration with random weights (weight_seed 1; seed 0 is the trained model):
    for tests whose float tolerances were set on random weights' magnitudes (tensor parallelism
    against one rank), which the trained model's outputs, about 100x larger, exceed."""
    return ensure_model_dir(
        tmp_path_factory.mktemp("model") / "random-tiny", replace(PipelineConfig.tiny(), weight_seed=1)
    )


@pytest.fixture(scope="session")
def mesh(tmp_path_factory, model_dir) -> Mesh:
    """One real mesh (`stagemesh up`: cache, two stages, gateway) shared by the service tests."""
    root = tmp_path_factory.mktemp("mesh")
    config = write_config(root / "mesh.toml", model_dir)
    shm_before = shm_entries()
    running = start_mesh(config, root / "mesh.log")
    yield running
    assert running.stop() == 0, running.logs()[-3000:]
    leaked = segments_of(shm_entries() - shm_before, running.child_pids())
    assert not leaked, f"shared-memory segments left behind: {leaked}"


@pytest.fixture
def harness_factory():
    """Makes workers on real queues (tests/support/worker_harness.py) and stops them after the test."""
    from tests.support.worker_harness import Harness

    made: list[Harness] = []

    def make(**kw) -> Harness:
        h = Harness(**kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.stop()


@pytest.fixture
def populated(tmp_path):
    """A runtime-cache root with one valid entry, one without a manifest, stale temp dirs."""
    from tests.support.cache_entries import populated_root

    return populated_root(tmp_path / "cache")

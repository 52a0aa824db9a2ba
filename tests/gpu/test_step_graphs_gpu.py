"""On a real GPU: denoising steps replayed from captured CUDA graphs give the eager loop's
images, for several shapes, on replay as on capture, and again after sleep and wake (which
move the weights the graphs point at)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_service.models import DiffusionRunner, PipelineConfig, WorkItem, ensure_model_dir
from stage_service.sleep import SleepController

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model_dir(tmp_path_factory.mktemp("models") / "tiny", PipelineConfig.tiny())


def _batch(size: int, rows: int, guidance: float, cond_len: int) -> list[WorkItem]:
    return [WorkItem(f"r{i}", "p", size, size, 3, guidance, 100 + i,
                     {"hidden_states": torch.randn(cond_len + i, 64, generator=torch.Generator().manual_seed(i))})
            for i in range(rows)]


def _images(runner: DiffusionRunner, batch: list[WorkItem]) -> list[torch.Tensor]:
    return [o["image"].cpu() for o in runner.run(batch)]


def test_graph_replay_gives_the_eager_images(model_dir):
    graphed = DiffusionRunner(model_dir, "cuda")
    eager = DiffusionRunner(model_dir, "cuda", cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    shapes = [(64, 1, 4.0, 5), (128, 4, 4.0, 12), (64, 2, 1.0, 20), (256, 3, 4.0, 7)]
    for size, rows, guidance, cond_len in shapes * 2:  # the second pass replays
        batch = _batch(size, rows, guidance, cond_len)
        for got, want in zip(_images(graphed, batch), _images(eager, batch)):
            assert torch.equal(got, want), (size, rows, guidance)
    assert len(graphed.graphs) == 4


def test_graphs_are_captured_again_after_sleep_and_wake(model_dir):
    runner = DiffusionRunner(model_dir, "cuda")
    batch = _batch(128, 2, 4.0, 9)
    before = _images(runner, batch)
    sleep = SleepController(runner.weight_files(), "cuda")
    for level in (1, 2):
        sleep.sleep(level, holders=runner.device_holders())
        assert len(runner.graphs) == 0
        sleep.wake()
        after = _images(runner, batch)
        assert all(torch.equal(a, b) for a, b in zip(after, before)), level

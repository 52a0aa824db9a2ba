"""On a real GPU: denoising steps replayed from captured CUDA graphs give the eager loop's
images, for several shapes, on replay as on capture, and again after sleep and wake (which
move the weights the graphs point at), also when the sleep controller was not told about them."""

from __future__ import annotations

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models import DiffusionRunner, WorkItem
from stagemesh.stage_service.worker.sleep import SleepController

pytestmark = pytest.mark.gpu


def _batch(size: int, rows: int, guidance: float, cond_len: int) -> list[WorkItem]:
    return [
        WorkItem(
            f"r{i}",
            Params("p", size, size, 3, guidance, 100 + i, "tensor"),
            {"hidden_states": torch.randn(cond_len + i, 64, generator=torch.Generator().manual_seed(i))},
        )
        for i in range(rows)
    ]


def _images(runner: DiffusionRunner, batch: list[WorkItem]) -> list[torch.Tensor]:
    return [o["image"].cpu() for o in runner.run(batch)]


def test_graph_replay_gives_the_eager_images(tiny_model):
    graphed = DiffusionRunner(tiny_model, "cuda")
    eager = DiffusionRunner(tiny_model, "cuda", cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    shapes = [(64, 1, 4.0, 5), (128, 4, 4.0, 12), (64, 2, 1.0, 20), (256, 3, 4.0, 7)]
    for size, rows, guidance, cond_len in shapes * 2:  # the second pass replays
        batch = _batch(size, rows, guidance, cond_len)
        for got, want in zip(_images(graphed, batch), _images(eager, batch)):
            assert torch.equal(got, want), (size, rows, guidance)
    assert len(graphed.graphs) == 4


@pytest.mark.parametrize("told", [True, False], ids=["holders", "no-holders"])
def test_graphs_are_captured_again_after_sleep_and_wake(tiny_model, told):
    # Told (as the worker does), sleep drops the graphs. Not told, the graphs stay while the
    # weights move: the next batch must see the new addresses and capture again (it used to
    # read freed memory).
    runner = DiffusionRunner(tiny_model, "cuda")
    batch = _batch(128, 2, 4.0, 9)
    before = _images(runner, batch)
    sleep = SleepController(runner.weight_files(), "cuda")
    for level in (1, 2):
        sleep.sleep(level, holders=runner.device_holders() if told else ())
        assert len(runner.graphs) == (0 if told else 1)
        sleep.wake()
        after = _images(runner, batch)
        assert all(torch.equal(a, b) for a, b in zip(after, before)), level

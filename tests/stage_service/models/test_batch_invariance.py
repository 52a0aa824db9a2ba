"""Batch invariance at the runner: the embedded diffusion runner's images for requests run one at
a time (models.batch_invariance.run_items_alone, what a worker does with batch_invariant) equal,
bit for bit, the images of the same requests run alone, whatever their batch mates; progress and
item errors keep a batch's meaning."""

from __future__ import annotations

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.batch_invariance import run_items_alone
from stagemesh.stage_service.models.contract import ItemError, WorkItem
from stagemesh.stage_service.models.runners import ArRunner, DiffusionRunner

# Prompt lengths that land in different conditioning buckets (8, 16, 32, 64 tokens).
PROMPTS = ("a", "a red fox", "a lighthouse on a cliff at night", "x" * 40, "two cats on a sofa, one asleep")


@pytest.fixture(scope="module")
def runners(tiny_model) -> tuple[ArRunner, DiffusionRunner]:
    return ArRunner(tiny_model), DiffusionRunner(tiny_model)


def requests(ar: ArRunner, guidance: float, steps: int = 2, size: int = 32) -> list[WorkItem]:
    items = []
    for i, prompt in enumerate(PROMPTS):
        params = Params(prompt, size, size, steps, guidance, 7000 + 13 * i, "png")
        cond = ar.run([WorkItem(f"r{i}", params)])[0]["hidden_states"]
        items.append(WorkItem(f"r{i}", params, {"hidden_states": cond}))
    return items


@pytest.mark.parametrize("guidance", [4.0, 1.0], ids=["guided", "unguided"])
def test_a_request_gets_the_same_image_in_any_batch_as_alone(runners, guidance):
    ar, diffusion = runners
    items = requests(ar, guidance)
    alone = {item.request_id: diffusion.run([item])[0]["image"] for item in items}
    batches = [items, items[::-1], items[1:3], [items[4], items[0], items[2]]]
    for batch in batches:
        outputs = run_items_alone(diffusion.run, batch)
        assert len(outputs) == len(batch)
        for item, out in zip(batch, outputs):
            assert torch.equal(out["image"], alone[item.request_id]), (item.request_id, [i.request_id for i in batch])


class Recorder:
    """A run function that records the batches it gets and reports `steps` steps for each."""

    def __init__(self, steps: int, fail_at: int | None = None) -> None:
        self.steps = steps
        self.fail_at = fail_at  # the request id whose run raises an ItemError
        self.batches: list[list[str]] = []

    def __call__(self, batch, progress=None):
        self.batches.append([item.request_id for item in batch])
        if batch[0].request_id == self.fail_at:
            raise ItemError(0, "bad conditioning")
        for step in range(1, self.steps + 1):
            if progress is not None:
                progress(step, self.steps)
        return [{"image": torch.tensor([float(i)])} for i, _ in enumerate(batch)]


def items(n: int) -> list[WorkItem]:
    return [WorkItem(f"r{i}", Params("p", 16, 16, 4, 1.0, i, "png")) for i in range(n)]


def test_each_item_runs_alone_and_progress_counts_the_batch_steps():
    run, seen = Recorder(steps=4), []
    outputs = run_items_alone(run, items(3), lambda step, total: seen.append((step, total)))
    assert run.batches == [["r0"], ["r1"], ["r2"]]
    assert len(outputs) == 3
    # 12 item steps over 3 items: steps 1..4 of 4, each once, the last when the last item ends.
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_a_single_item_and_no_progress_pass_straight_through():
    run, seen = Recorder(steps=2), []
    run_items_alone(run, items(1), lambda step, total: seen.append((step, total)))
    assert seen == [(1, 2), (2, 2)]
    run_items_alone(run, items(2))  # no progress: nothing to report, nothing fails
    assert run.batches[-2:] == [["r0"], ["r1"]]


def test_a_raising_progress_stops_the_rest_of_the_batch():
    class Cancelled(Exception):
        pass

    def progress(step, total):
        if step == 2:
            raise Cancelled

    run = Recorder(steps=4)
    with pytest.raises(Cancelled):
        run_items_alone(run, items(4), progress)
    # Step 2 of 4 is the batch's 8th item step of 16: the end of the second item.
    assert run.batches == [["r0"], ["r1"]]


def test_an_item_error_names_the_item_in_the_batch():
    run = Recorder(steps=1, fail_at="r2")
    with pytest.raises(ItemError) as caught:
        run_items_alone(run, items(4))
    assert caught.value.index == 2
    assert "bad conditioning" in str(caught.value)

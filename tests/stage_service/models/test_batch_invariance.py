"""Batch invariance at the runner (models.batch_invariance): with invariant_rows the embedded
diffusion runner gives each request, bit for bit, the image it gives the request alone, whatever
its batch mates (batches of mixed conditioning lengths included); so does running each request
as a batch of its own (run_items_alone, what a worker does for a runner that cannot fix its
shapes). Grouping, progress and item errors keep a batch's meaning."""

from __future__ import annotations

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.batch_invariance import groups_by_key, padding_key, run_in_groups, run_items_alone
from stagemesh.stage_service.models.contract import ItemError, WorkItem
from stagemesh.stage_service.models.runners import ArRunner, DiffusionRunner

# Prompt lengths that land in different conditioning buckets (8, 16, 32, 64 tokens).
PROMPTS = ("a", "a red fox", "a lighthouse on a cliff at night", "x" * 40, "two cats on a sofa, one asleep")


@pytest.fixture(scope="module")
def runners(tiny_model) -> tuple[ArRunner, DiffusionRunner, DiffusionRunner]:
    """The AR runner, the diffusion runner with batch_invariant (4 requests a pass) and without."""
    return ArRunner(tiny_model), DiffusionRunner(tiny_model, invariant_rows=4), DiffusionRunner(tiny_model)


def requests(ar: ArRunner, guidance: float, steps: int = 2, size: int = 32) -> list[WorkItem]:
    items = []
    for i, prompt in enumerate(PROMPTS):
        params = Params(prompt, size, size, steps, guidance, 7000 + 13 * i, "png")
        cond = ar.run([WorkItem(f"r{i}", params)])[0]["hidden_states"]
        items.append(WorkItem(f"r{i}", params, {"hidden_states": cond}))
    return items


BATCHES = ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [1, 2], [4, 0, 2], [3, 3, 1])


@pytest.mark.parametrize("guidance", [4.0, 1.0], ids=["guided", "unguided"])
def test_a_request_gets_the_same_image_in_any_batch_as_alone(runners, guidance):
    ar, invariant, _ = runners
    items = requests(ar, guidance)
    alone = [invariant.run([item])[0]["image"] for item in items]
    for indices in BATCHES:
        outputs = invariant.run([items[i] for i in indices])
        assert len(outputs) == len(indices)
        for i, out in zip(indices, outputs):
            assert torch.equal(out["image"], alone[i]), (i, indices)


def test_one_request_at_a_time_gives_the_image_of_the_request_alone(runners):
    ar, _, plain = runners
    items = requests(ar, 4.0)
    alone = [plain.run([item])[0]["image"] for item in items]
    for indices in BATCHES[:3]:
        outputs = run_items_alone(plain.run, [items[i] for i in indices])
        for i, out in zip(indices, outputs):
            assert torch.equal(out["image"], alone[i]), (i, indices)


def test_requests_pad_alike_by_conditioning_bucket():
    def key(length: int) -> tuple:
        return padding_key({"hidden_states": torch.zeros(length, 64)})

    assert key(1) == key(8) != key(9) == key(16) != key(17)
    assert padding_key({}) == ()
    assert groups_by_key(["a", "b", "a", "a", "b", "a"], 2) == [[0, 2], [3, 5], [1, 4]]


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


def test_groups_run_as_batches_and_outputs_keep_the_batch_order():
    run, seen = Recorder(steps=2), []
    outputs = run_in_groups(run, items(5), [[0, 3], [1], [2, 4]], lambda step, total: seen.append((step, total)))
    assert run.batches == [["r0", "r3"], ["r1"], ["r2", "r4"]]
    # The recorder's outputs count within each run: 0, 1 | 0 | 0, 1, put back in batch order.
    assert [o["image"].item() for o in outputs] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert seen == [(1, 2), (2, 2)]


def test_an_item_error_names_the_item_in_the_batch():
    run = Recorder(steps=1, fail_at="r2")
    with pytest.raises(ItemError) as caught:
        run_items_alone(run, items(4))
    assert caught.value.index == 2
    assert "bad conditioning" in str(caught.value)
    with pytest.raises(ItemError) as caught:
        run_in_groups(run, items(4), [[3], [2, 0], [1]])
    assert caught.value.index == 2

"""A worker with batch_invariant hands a runner that cannot fix its own batch shapes one request
at a time (each with the shapes it has alone) and still answers for the batch as one: every
output in order, progress in steps of the batch, an item's failure naming its place in the batch.
Without the option, or with a runner that fixes its shapes itself, the runner gets the batch.

Real multiprocessing queues, real threads, real packing (tests/support/worker_harness.py).
"""

from __future__ import annotations

import pytest
import torch

from stagemesh.stage_service.models.contract import ItemError
from stagemesh.stage_service.transport import ipc, protocol
from tests.support.shm_guard import no_segment_left_behind  # noqa: F401 - autouse fixture
from tests.support.worker_harness import StubRunner, item

STEPS = 3


class CountingRunner(StubRunner):
    """Records the size of every batch it runs, reports STEPS steps, and refuses one seed as a
    single item's fault."""

    def __init__(self, bad_seed: int | None = None) -> None:
        super().__init__()
        self.bad_seed = bad_seed
        self.batch_sizes: list[int] = []

    def run(self, items, progress):
        self.batch_sizes.append(len(items))
        for index, it in enumerate(items):
            if it.params.seed == self.bad_seed:
                raise ItemError(index, f"seed {it.params.seed} has no conditioning")
        for step in range(1, STEPS + 1):
            progress(step, STEPS)
        return [{"image": torch.full((4,), float(it.params.seed))} for it in items]


def results_of(h) -> tuple[list[protocol.Progress], list[dict]]:
    steps = []
    while not isinstance(msg := h.next(), protocol.Result):
        steps.append(msg)
    return steps, ipc.unpack(msg.outputs)


@pytest.mark.parametrize("invariant", [True, False], ids=["batch_invariant", "batched"])
def test_the_runner_gets_one_request_at_a_time_only_with_batch_invariant(harness_factory, invariant):
    runner = CountingRunner()
    h = harness_factory(runner=runner, step_execution=True, batch_invariant=invariant)
    h.send(protocol.Execute("rpc-1", [item(5), item(6), item(7)]))
    steps, outputs = results_of(h)
    assert runner.batch_sizes == ([1, 1, 1] if invariant else [3])
    assert [o["image"][0].item() for o in outputs] == [5.0, 6.0, 7.0]
    assert [(p.step, p.total) for p in steps] == [(1, STEPS), (2, STEPS), (3, STEPS)]


def test_an_item_failing_alone_names_its_place_in_the_batch(harness_factory):
    h = harness_factory(runner=CountingRunner(bad_seed=8), step_execution=True, batch_invariant=True)
    h.send(protocol.Execute("rpc-2", [item(5), item(8), item(7)]))
    failure = h.next_of(protocol.Failure)
    assert failure.rpc_id == "rpc-2" and failure.item == 1 and "no conditioning" in failure.message


class InvariantRunner(CountingRunner):
    """A runner that fixes its own batch shapes (as the embedded diffusion runner does)."""

    batch_invariant = True


def test_a_runner_that_fixes_its_shapes_gets_the_whole_batch(harness_factory):
    runner = InvariantRunner()
    h = harness_factory(runner=runner, step_execution=True, batch_invariant=True)
    h.send(protocol.Execute("rpc-3", [item(5), item(6)]))
    _, outputs = results_of(h)
    assert runner.batch_sizes == [2]
    assert [o["image"][0].item() for o in outputs] == [5.0, 6.0]

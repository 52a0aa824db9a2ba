"""Under batch_invariant a diffusion stage batches only requests whose conditioning pads to the same
length (the runner runs each pass at fixed shapes; a mixed batch would take one pass per length);
without it, every request with the same size, steps and guidance may join. The option (flag,
mesh.toml key) reaches each worker as the number of requests every pass runs with."""

from __future__ import annotations

import argparse
import collections

import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.engine.dispatch import BatchDispatcher
from stagemesh.stage_service.engine.request import StageRequest
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models.runners import DiffusionRunner, WorkItem
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.settings.dlo import DloOptions


def request(name: str, cond_rows: int, steps: int = 2) -> StageRequest:
    params = Params("p", 32, 32, steps, 4.0, 1, "png")
    return StageRequest(name, params, {"hidden_states": torch.zeros(cond_rows, 64)})


def batches(dispatcher: BatchDispatcher, waiting: list[StageRequest]) -> list[list[str]]:
    queue = collections.deque(waiting)
    out = []
    while queue:
        out.append([r.request_id for r in dispatcher.take(queue)])
    return out


# Conditioning rows 6 and 8 pad to 8; 9 and 16 to 16; 40 to 64. "s1" differs in steps.
WAITING = [("a", 6), ("b", 9), ("c", 8), ("d", 16), ("e", 40), ("f", 7), ("g", 5), ("h", 8)]


def waiting() -> list[StageRequest]:
    return [request(name, rows) for name, rows in WAITING] + [request("s1", 6, steps=1)]


def test_batch_invariant_batches_requests_that_pad_alike():
    dispatcher = BatchDispatcher(None, "diffusion", 4, batch_invariant=True)  # type: ignore[arg-type]
    assert batches(dispatcher, waiting()) == [["a", "c", "f", "g"], ["b", "d"], ["e"], ["h"], ["s1"]]


def test_without_it_the_conditioning_length_does_not_matter():
    dispatcher = BatchDispatcher(None, "diffusion", 4)  # type: ignore[arg-type]
    assert batches(dispatcher, waiting()) == [["a", "b", "c", "d"], ["e", "f", "g", "h"], ["s1"]]


def test_stages_that_run_requests_alone_batch_anything():
    dispatcher = BatchDispatcher(None, "ar", 4, batch_invariant=True)  # type: ignore[arg-type]
    assert [len(b) for b in batches(dispatcher, waiting())] == [4, 4, 1]


def rows_per_pass(**values) -> list[int]:
    executor = Executor(StageSettings(stage_id=1, kind="diffusion", model_dir="unused", **values))
    return [spec.settings.invariant_rows() for g in executor.groups for spec in g.specs]


def test_the_option_reaches_every_worker_as_its_rows_per_pass():
    parser = argparse.ArgumentParser()
    StageSettings.add_arguments(parser)
    assert StageSettings.from_args(parser.parse_args([])).batch_invariant  # on by default
    off = StageSettings.from_args(parser.parse_args(["--kind", "diffusion", "--no-batch-invariant"]))
    assert not off.batch_invariant
    assert not StageSettings.from_args(parser.parse_args(off.to_flags())).batch_invariant
    assert not StageSettings.from_mapping({"kind": "diffusion", "batch_invariant": False}).batch_invariant
    assert rows_per_pass() == [4]
    assert rows_per_pass(max_batch_size=2, workers=2) == [2, 2]
    assert rows_per_pass(batch_invariant=False) == [0]
    # A DP wave gives each rank one request, run with the rows it has on a one-rank stage.
    assert rows_per_pass(enable_dlo=True, dp_size=2) == [4, 4]


def test_a_dp_rank_draws_the_bits_a_one_rank_stage_draws(tiny_model):
    """A DP rank running its request at one row rounded differently from the max_batch_size rows
    of a one-rank stage (Linear's bits depend on its row count), which now and then changed a PNG."""
    [one_rank] = rows_per_pass()
    [dp_rank, _] = rows_per_pass(enable_dlo=True, dp_size=2)
    runners = [
        DiffusionRunner(tiny_model, invariant_rows=one_rank),
        DiffusionRunner(tiny_model, dlo=DloOptions(enable_dlo=True), invariant_rows=dp_rank),
    ]
    cond = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    item = WorkItem("r", Params("p", 32, 32, 2, 4.0, 2, "png"), {"hidden_states": cond})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        images = [runner.run([item])[0]["image"] for runner in runners]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(images[0], images[1])

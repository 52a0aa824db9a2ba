"""Batch invariance on a real GPU, where cuBLAS and cuDNN choose kernels by problem size: with
invariant_rows the embedded diffusion runner gives each request the image it gives it alone,
whatever its batch mates, with captured step graphs and eagerly; so does running each request as
a batch of its own (the fallback for other runners); and through a real mesh whose diffusion
stage runs on the GPU, 200 mixed requests give the same PNG bytes served one at a time and
batched under load."""

from __future__ import annotations

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.batch_invariance import run_items_alone
from stagemesh.stage_service.models.contract import WorkItem
from stagemesh.stage_service.models.runners import ArRunner, DiffusionRunner
from tests.support.invariance import check_alone_equals_under_load, start_invariant_mesh

pytestmark = pytest.mark.gpu

PROMPTS = ("a", "a red fox", "a lighthouse on a cliff at night", "x" * 40, "two cats on a sofa, one asleep")


def _requests(ar: ArRunner, size: int, guidance: float) -> list[WorkItem]:
    items = []
    for i, prompt in enumerate(PROMPTS):
        params = Params(prompt, size, size, 3, guidance, 500 + 31 * i, "png")
        cond = ar.run([WorkItem(f"r{i}", params)])[0]["hidden_states"]
        items.append(WorkItem(f"r{i}", params, {"hidden_states": cond}))
    return items


BATCHES = ([0, 1, 2, 3], [4, 3, 2, 1], [1, 2], [4, 0, 2], [3, 3, 1, 0])


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_a_request_gets_the_same_image_in_any_batch_as_alone(tiny_model, graphs):
    ar = ArRunner(tiny_model, "cuda")
    invariant = DiffusionRunner(tiny_model, "cuda", cuda_graphs=graphs, invariant_rows=4)
    for size, guidance in ((64, 4.0), (256, 4.0), (128, 1.0)):
        items = _requests(ar, size, guidance)
        alone = [invariant.run([item])[0]["image"].cpu() for item in items]
        for indices in BATCHES:
            outputs = invariant.run([items[i] for i in indices])
            for i, out in zip(indices, outputs):
                assert torch.equal(out["image"].cpu(), alone[i]), (size, guidance, i, indices)


def test_one_request_at_a_time_gives_the_image_of_the_request_alone(tiny_model):
    ar = ArRunner(tiny_model, "cuda")
    plain = DiffusionRunner(tiny_model, "cuda")
    items = _requests(ar, 256, 4.0)
    alone = [plain.run([item])[0]["image"].cpu() for item in items]
    for indices in BATCHES[:3]:
        outputs = run_items_alone(plain.run, [items[i] for i in indices])
        for i, out in zip(indices, outputs):
            assert torch.equal(out["image"].cpu(), alone[i]), (i, indices)


def test_200_requests_give_the_same_bytes_alone_and_batched_on_the_gpu(tmp_path, model_dir):
    mesh = start_invariant_mesh(tmp_path, model_dir, device="cuda")
    try:
        check_alone_equals_under_load(mesh)
    finally:
        assert mesh.stop() == 0, mesh.logs()[-3000:]

"""Batch invariance on a real GPU, where cuBLAS and cuDNN choose kernels by problem size: the
embedded diffusion runner's images for requests run one at a time (what a worker does with
batch_invariant) equal the images of the same requests run alone, with captured step graphs and
eagerly; and through a real mesh whose diffusion stage runs on the GPU, 200 mixed requests give
the same PNG bytes served one at a time and batched under load."""

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


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_a_request_gets_the_same_image_in_any_batch_as_alone(tiny_model, graphs):
    ar = ArRunner(tiny_model, "cuda")
    diffusion = DiffusionRunner(tiny_model, "cuda", cuda_graphs=graphs)
    for size, guidance in ((64, 4.0), (256, 4.0), (128, 1.0)):
        items = _requests(ar, size, guidance)
        alone = {item.request_id: diffusion.run([item])[0]["image"].cpu() for item in items}
        for batch in (items, items[::-1], items[1:4]):
            outputs = run_items_alone(diffusion.run, batch)
            for item, out in zip(batch, outputs):
                assert torch.equal(out["image"].cpu(), alone[item.request_id]), (size, guidance, item.request_id)


def test_200_requests_give_the_same_bytes_alone_and_batched_on_the_gpu(tmp_path, model_dir):
    mesh = start_invariant_mesh(tmp_path, model_dir, device="cuda")
    try:
        check_alone_equals_under_load(mesh)
    finally:
        assert mesh.stop() == 0, mesh.logs()[-3000:]

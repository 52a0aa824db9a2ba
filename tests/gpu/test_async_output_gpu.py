"""On a real GPU, outputs that went through the side stream and background thread must equal the
synchronous path's, over many random requests (no stream race)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.contract import WorkItem
from stagemesh.stage_service.models.weights import ensure_model_dir
from stagemesh.stage_service.settings import StageSettings

pytestmark = pytest.mark.gpu


def _items(rng: random.Random, n: int) -> list[list[WorkItem]]:
    batches = []
    for _ in range(n):
        size = rng.choice([64, 128, 256, 512])
        steps = rng.randint(1, 4)
        guidance = rng.choice([1.0, 4.0])  # a batch shares size, steps and guidance
        batch = [
            WorkItem(
                f"r{i}",
                Params("", size, size, steps, guidance, rng.randrange(2**31), "tensor"),
                {
                    "hidden_states": torch.randn(
                        rng.randint(1, 12), 64, generator=torch.Generator().manual_seed(rng.randrange(2**31))
                    )
                },
            )
            for i in range(rng.randint(1, 4))
        ]
        batches.append(batch)
    return batches


def _run_all(executor: Executor, batches) -> list[list[torch.Tensor]]:
    # Submit everything at once so forward passes overlap with the previous outputs' copies.
    submitted = [executor.submit(0, batch)[1] for batch in batches]
    results = []
    for batch, fut in zip(batches, submitted):
        done = fut.result(timeout=300)
        if isinstance(done, list):
            results.append([o["image"] for o in done])
            continue
        ids = executor.outputs.split(done.async_output_id, [item.request_id for item in batch])
        results.append([executor.outputs.wait_output_ready(i, 300)["image"] for i in ids])
    return results


def test_async_outputs_equal_the_synchronous_path(tmp_path):
    model_dir = ensure_model_dir(tmp_path / "model", PipelineConfig.tiny())
    batches = _items(random.Random(1234), 60)
    outputs = {}
    for step_execution in (True, False):
        settings = StageSettings(
            stage_id=1, kind="diffusion", model_dir=str(model_dir), device="cuda", step_execution=step_execution
        )
        executor = Executor(settings)
        executor.start()
        try:
            outputs[step_execution] = _run_all(executor, batches)
            assert executor.outputs.is_empty()
        finally:
            executor.shutdown()
    for sync_batch, async_batch in zip(outputs[True], outputs[False]):
        for sync_image, async_image in zip(sync_batch, async_batch):
            assert torch.equal(sync_image, async_image)


def test_a_batch_comes_over_in_one_copy_and_its_slices_go_by_the_batch_storage():
    from stagemesh.stage_service import platform
    from stagemesh.stage_service.transport import ipc
    from stagemesh.stage_service.worker.async_output import copy_to_host

    stream = platform.Stream("cuda")
    batch = torch.rand(4, 3, 256, 256, device="cuda").permute(0, 2, 3, 1)  # as the DiT's images
    outputs = [{"image": img} for img in batch]
    odd = torch.rand(1000, 1000, device="cuda")[:10]  # a small view of a big storage: not whole
    with stream.active():
        host = copy_to_host({"batch": outputs, "odd": odd}, stream)
    stream.synchronize()
    images = [o["image"] for o in host["batch"]]
    assert len({img.untyped_storage().data_ptr() for img in images}) == 1
    assert images[0].untyped_storage().nbytes() == batch.numel() * 4
    assert host["odd"].untyped_storage().nbytes() == odd.numel() * 4  # only its own bytes
    for img, dev in zip(images, batch):
        assert img.is_pinned() and torch.equal(img, dev.cpu())
    # 786,432 bytes each, but slices of a 3 MB storage: shared memory, each with its own bytes.
    packed = ipc.Packer(os.getpid(), 0).pack(images)
    try:
        assert all(p.shm_name is not None and p.nbytes == 256 * 256 * 3 * 4 for p in packed)
    finally:
        unpacked = ipc.unpack(packed)
    assert all(torch.equal(u, dev.cpu()) for u, dev in zip(unpacked, batch))

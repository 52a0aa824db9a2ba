"""Sleep and wake on a real GPU: memory really free, really back, no growth over cycles."""

from __future__ import annotations

import resource

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.config import DiTConfig, LMConfig, PipelineConfig
from stagemesh.stage_service.models.runners import DiffusionRunner, WorkItem
from stagemesh.stage_service.models.weights import ensure_model_dir
from stagemesh.stage_service.worker.sleep import SleepController

pytestmark = pytest.mark.gpu


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _sample(runner: DiffusionRunner) -> torch.Tensor:
    cond = torch.randn(8, runner.config.dit.cond_dim, generator=torch.Generator().manual_seed(0)).to(runner.device)
    return runner.run([WorkItem("r", Params("p", 256, 256, 4, 4.0, 7, "tensor"), {"hidden_states": cond})])[0][
        "image"
    ].cpu()


def test_sleep_frees_device_memory_and_wake_restores_the_output(tmp_path):
    # Wide enough (~0.5 GB) that the weights, not allocator rounding, dominate the measurement.
    config = PipelineConfig(lm=LMConfig(), dit=DiTConfig(hidden_size=1024, depth=10, num_heads=16, cond_dim=64))
    model_dir = ensure_model_dir(tmp_path / "m", config)
    runner = DiffusionRunner(model_dir, "cuda:0")
    before = _sample(runner)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    controller = SleepController(runner.weight_files(), "cuda:0")
    weights = controller.weight_bytes
    assert weights >= 0.9 * held
    for level in (1, 2):
        result = controller.sleep(level, holders=runner.device_holders())  # as the worker does
        # Measured by the driver (mem_get_info), not a sum of parameter sizes.
        assert result.freed_bytes >= 0.95 * held, (level, result.freed_bytes, held, weights)
        assert torch.cuda.memory_allocated() <= held - 0.95 * weights, (level, torch.cuda.memory_allocated(), held)
        woken = controller.wake()
        assert woken.freed_bytes >= 0.95 * weights, (level, woken.freed_bytes, weights)  # really back
        assert torch.equal(_sample(runner), before)

    torch.cuda.synchronize()
    first_allocated, first_rss = None, None
    for cycle in range(20):
        controller.sleep(1 + cycle % 2, holders=runner.device_holders())
        controller.wake()
        torch.cuda.synchronize()
        if first_allocated is None:
            first_allocated, first_rss = torch.cuda.memory_allocated(), _rss_bytes()
    assert abs(torch.cuda.memory_allocated() - first_allocated) <= 0.01 * first_allocated
    assert _rss_bytes() <= 1.05 * first_rss
    assert torch.equal(_sample(runner), before)

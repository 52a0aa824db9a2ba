"""On a real GPU: compiled blocks of the embedded DiT inside its captured step graphs give images
close to the eager loop's, and survive a level-1 sleep without compiling again; the FP8 layer
computes its float32 reference through torch._scaled_mm's CUDA kernel (compute capability 8.9+),
compiled as in a stage."""

from __future__ import annotations

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models import DiffusionRunner, WorkItem
from stagemesh.stage_service.models.acceleration import compile as regional
from stagemesh.stage_service.models.acceleration import fp8
from stagemesh.stage_service.worker.sleep import SleepController

pytestmark = pytest.mark.gpu


def _batch(size: int, rows: int) -> list[WorkItem]:
    return [
        WorkItem(
            f"r{i}",
            Params("p", size, size, 3, 4.0, 100 + i, "tensor"),
            {"hidden_states": torch.randn(9 + i, 64, generator=torch.Generator().manual_seed(i))},
        )
        for i in range(rows)
    ]


def test_compiled_blocks_inside_step_graphs_match_eager_and_survive_sleep(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    compiled = DiffusionRunner(tiny_model, "cuda")
    eager = DiffusionRunner(tiny_model, "cuda", cuda_graphs=False)
    regional.compile_blocks(compiled.dit)
    assert compiled.graphs is not None  # the graphs capture the compiled kernels
    batch = _batch(64, 2)
    want = [o["image"].cpu() for o in eager.run(batch)]
    got = [o["image"].cpu() for o in compiled.run(batch)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=2 / 255)
    graphs = regional.compile_counters()["graphs"]
    sleep = SleepController(compiled.weight_files(), "cuda")
    sleep.sleep(1, holders=compiled.device_holders())
    sleep.wake()
    again = [o["image"].cpu() for o in compiled.run(batch)]
    for a, b in zip(again, got):
        torch.testing.assert_close(a, b, rtol=0, atol=1 / 255)
    assert regional.compile_counters()["graphs"] == graphs
    sleep.close()


def test_fp8_layer_compiled_on_the_gpu_computes_its_reference():
    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        pytest.skip("FP8 matmuls need compute capability 8.9+")
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512).to("cuda", torch.bfloat16)
    layer = fp8.Fp8Linear(linear)
    x = torch.randn(4, 77, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer.forward, fullgraph=True)
    with torch.inference_mode():
        got = compiled(x)
        torch.testing.assert_close(got.float(), fp8.reference_linear(layer, x), rtol=2e-2, atol=2e-2)
        assert fp8.cosine(got, linear(x)) > 0.99

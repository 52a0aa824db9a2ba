"""DLO on a CUDA device (skipped without one): real streams, events and pinned memory."""

from __future__ import annotations

import pytest
import torch

from stagemesh.stage_service.models.config import DiTConfig
from stagemesh.stage_service.models.dit import DiT
from stagemesh.stage_service.offload import LayerwiseOffload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = DiTConfig(hidden_size=256, num_heads=4, cond_dim=64, decoder_channels=8)


def _dit(depth: int) -> DiT:
    torch.manual_seed(0)
    model = DiT(DiTConfig(**{**CFG.__dict__, "depth": depth}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def _run(model: DiT, iterations: int = 4) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for k in range(iterations):
            g = torch.Generator().manual_seed(k)
            x, t = torch.randn(2, 4, 32, 32, generator=g), torch.rand(2, generator=g)
            c = torch.randn(2, 77, 64, generator=g)
            out.append(model(x.cuda(), t.cuda(), c.cuda()).float().cpu())
    torch.cuda.synchronize()
    return out


def _offloaded(depth: int, **kwargs) -> tuple[DiT, LayerwiseOffload]:
    model = _dit(depth)
    return model, LayerwiseOffload(model, "cuda", **kwargs)


@pytest.mark.parametrize("depth", [3, 7, 70])
def test_bf16_output_matches_the_resident_model(depth: int):
    want = _run(_dit(depth).cuda())
    model, engine = _offloaded(depth)
    got = _run(model)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert all(buf.pinned and buf.tensor.is_pinned() for buf in engine.store.buffers)
    assert engine.stats().host_bytes <= 1.05 * engine.stats().payload_bytes


def test_resident_layers_and_staging_are_bitwise_equal_to_plain_dlo():
    plain = _run(_offloaded(7)[0])
    resident = _run(_offloaded(7, use_allgather=False, resident_layers=3)[0])
    staged = _run(_offloaded(7, keep_source=True)[0])
    assert all(torch.equal(a, b) for a, b in zip(plain, resident))
    assert all(torch.equal(a, b) for a, b in zip(plain, staged))


def test_a_runtime_cache_style_mapping_is_page_locked_and_copied_from_directly(tmp_path):
    from safetensors.torch import save_file

    from stagemesh.weight_store.checkpoint import map_tensors

    plain = _run(_offloaded(7)[0])
    model = _dit(7)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "entry.safetensors"))
    model.load_state_dict(map_tensors(tmp_path / "entry.safetensors"), assign=True)
    engine = LayerwiseOffload(model, "cuda", keep_source=True)
    assert engine.stats().host_mode == "locked"
    assert all(torch.equal(a, b) for a, b in zip(_run(model), plain))
    engine.close()
    engine.store.close()


def test_device_memory_is_bounded_by_two_slots():
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()  # earlier tests' leftovers, cuBLAS workspaces
    model, engine = _offloaded(12)
    torch.cuda.synchronize()
    block = max(layout.nbytes for layout in engine.layouts)
    streamed = sum(layout.nbytes for layout in engine.layouts)
    block_ids = {id(t) for layout in engine.layouts for t in layout.module.parameters()}
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in block_ids)
    held = torch.cuda.memory_allocated() - baseline
    # Two slots and the non-block weights, never the streamed blocks themselves.
    assert engine.stats().slot_bytes == 2 * block
    assert held <= 2 * block + resident + (4 << 20), (held, block, resident, streamed)

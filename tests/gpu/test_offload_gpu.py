"""DLO on a CUDA device (skipped without one): real streams, events and pinned memory."""

from __future__ import annotations

import pytest
import torch

from stagemesh.stage_service.models.dit import DiT
from stagemesh.stage_service.offload import LayerwiseOffload
from tests.support.small_dit import run_on_cuda, small_dit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _offloaded(depth: int, **kwargs) -> tuple[DiT, LayerwiseOffload]:
    model = small_dit(depth)
    return model, LayerwiseOffload(model, "cuda", **kwargs)


@pytest.mark.parametrize("depth", [3, 7, 70])
def test_bf16_output_matches_the_resident_model(depth: int):
    want = run_on_cuda(small_dit(depth).cuda())
    model, engine = _offloaded(depth)
    got = run_on_cuda(model)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert all(buf.pinned and buf.tensor.is_pinned() for buf in engine.store.buffers)
    assert engine.stats().host_bytes <= 1.05 * engine.stats().payload_bytes


def test_resident_layers_and_staging_are_bitwise_equal_to_plain_dlo():
    plain = run_on_cuda(_offloaded(7)[0])
    resident = run_on_cuda(_offloaded(7, use_allgather=False, resident_layers=3)[0])
    staged = run_on_cuda(_offloaded(7, keep_source=True)[0])
    assert all(torch.equal(a, b) for a, b in zip(plain, resident))
    assert all(torch.equal(a, b) for a, b in zip(plain, staged))


def test_a_runtime_cache_style_mapping_is_page_locked_and_copied_from_directly(tmp_path):
    from safetensors.torch import save_file

    from stagemesh.weight_store.checkpoint import map_tensors

    plain = run_on_cuda(_offloaded(7)[0])
    model = small_dit(7)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "entry.safetensors"))
    model.load_state_dict(map_tensors(tmp_path / "entry.safetensors"), assign=True)
    engine = LayerwiseOffload(model, "cuda", keep_source=True)
    assert engine.stats().host_mode == "locked"
    assert all(torch.equal(a, b) for a, b in zip(run_on_cuda(model), plain))
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

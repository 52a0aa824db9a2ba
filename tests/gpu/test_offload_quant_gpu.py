"""8-bit (FP8 and int8) weight streaming for DLO on a CUDA device (skipped without one): real copy
and rebuild streams, pinned 8-bit host buffers, a page-locked runtime-cache-style mapping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stagemesh.stage_service.models.dit import DiT
from stagemesh.stage_service.offload import LayerwiseOffload, dequant, quant
from stagemesh.stage_service.offload import streamer as streamer_mod
from tests.support.small_dit import run_on_cuda, small_dit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FP8 = torch.float8_e4m3fn


def _dequantised(depth: int, dtype: torch.dtype = FP8) -> DiT:
    """The model under DLO in its own dtype with every streamed Linear weight replaced by
    q * scale (computed on the device, as the engine rebuilds it): FP8 streaming must compute
    exactly what this computes, since both run the blocks from slots with the same kernels."""
    model = small_dit(depth)
    for name in quant.quantized_specs(model):
        p = model.get_parameter(name)
        q, scale = quant.quantize_rows(p, "cuda", dtype)
        rebuilt = p.detach().cuda()
        quant.dequantize_into(rebuilt, q.cuda(), scale.cuda())
        p.data = rebuilt.cpu()
    LayerwiseOffload(model, "cuda")
    return model


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.parametrize("dtype", [FP8, torch.int8])
@pytest.mark.parametrize("depth", [7, 70])
def test_8_bit_streaming_equals_its_dequantised_weights_and_stays_close_to_bf16(depth: int, dtype):
    want = run_on_cuda(_dequantised(depth, dtype))
    bf16 = run_on_cuda(small_dit(depth).cuda())
    model = small_dit(depth)
    engine = LayerwiseOffload(model, "cuda", stream_dtype=dtype)
    got = run_on_cuda(model)
    # Bit for bit: the rebuild on the second stream never races the copy or the compute.
    for a, b in zip(got, want):
        assert torch.equal(a, b), float((a - b).abs().max())
    assert min(_cosine(a, b) for a, b in zip(got, bf16)) >= 0.995
    assert all(buf.pinned and buf.tensor.is_pinned() for buf in engine.store.buffers)
    base = LayerwiseOffload(small_dit(depth), "cuda").stats()
    assert engine.stats().host_bytes <= 0.55 * base.host_bytes
    assert engine.transfers == 1 + 4 * depth


def test_fp8_with_resident_layers_and_after_sleep():
    want = run_on_cuda(_dequantised(7))
    plain = small_dit(7)
    LayerwiseOffload(plain, "cuda", stream_dtype=FP8)
    model = small_dit(7)
    engine = LayerwiseOffload(model, "cuda", stream_dtype=FP8, use_allgather=False, resident_layers=3)
    # Resident blocks are not quantised: close to the dequantised model, not equal.
    got = run_on_cuda(model)
    assert min(_cosine(a, b) for a, b in zip(got, want)) >= 0.995
    assert engine.release_device() > 0
    engine.restore_device()
    assert all(torch.equal(a, b) for a, b in zip(run_on_cuda(model), got))
    assert all(torch.equal(a, b) for a, b in zip(run_on_cuda(plain), want))


def test_an_fp8_mapping_is_page_locked_and_streamed_from_directly(tmp_path):
    from safetensors.torch import save_file

    from stagemesh.weight_store.checkpoint import map_tensors

    want = run_on_cuda(_dequantised(7))
    model = small_dit(7)
    names = quant.quantized_specs(model)
    entry = {k: v.contiguous() for k, v in model.state_dict().items() if k not in names}
    for name in names:
        entry[name], entry[name + ".fp8_scale"] = quant.quantize_rows(model.get_parameter(name), "cuda")
    save_file(entry, str(tmp_path / "entry.safetensors"))
    mapped = map_tensors(tmp_path / "entry.safetensors")
    state = {k: mapped[k] if k not in names else quant.placeholder(*names[k]) for k in model.state_dict()}
    model.load_state_dict(state, assign=True)
    given = {name: (mapped[name], mapped[name + ".fp8_scale"]) for name in names}
    engine = LayerwiseOffload(model, "cuda", keep_source=True, stream_dtype=FP8, quantized=given)
    assert engine.stats().host_mode == "locked" and engine.stats().host_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(run_on_cuda(model), want))
    engine.close()
    engine.store.close()


def test_fp8_device_memory_is_two_slots_and_the_fp8_staging_ring():
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    model = small_dit(12)
    engine = LayerwiseOffload(model, "cuda", stream_dtype=FP8)
    torch.cuda.synchronize()
    slot = max(layout.nbytes for layout in engine.layouts)
    packed = max(s.nbytes for s in engine.streams)
    assert packed <= 0.55 * slot
    block_ids = {id(t) for layout in engine.layouts for t in layout.module.parameters()}
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in block_ids)
    held = torch.cuda.memory_allocated() - baseline
    ring = streamer_mod.STAGING_BUFFERS * packed
    assert engine.stats().slot_bytes == 2 * slot + ring
    assert held <= 2 * slot + ring + resident + (4 << 20), (held, slot, packed, resident)


@pytest.mark.parametrize("stream", [FP8, torch.int8])
@pytest.mark.parametrize("shape", [(3072, 3072), (18432, 3072), (3072, 12288), (7, 33), (1, 1)])
def test_the_one_pass_rebuild_equals_the_two_pass_one_bit_for_bit(shape, stream):
    """dequant.py's Triton kernel and torch's copy + mul round the same product once."""
    if dequant._triton_kernel() is None:
        pytest.skip("triton is not installed")
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    w = torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32).mul_(0.02)
    w[0, 0] = 0.0  # zero and a row of zeros stay exact
    q, scale = (t.cuda() for t in quant.quantize_rows(w, "cuda", stream))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        one_pass = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        two_pass = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        dequant.dequantize_into(one_pass, q, scale, kernel="triton")
        dequant.dequantize_into(two_pass, q, scale, kernel="torch")
        assert torch.equal(one_pass.view(-1).view(torch.uint8), two_pass.view(-1).view(torch.uint8)), dtype

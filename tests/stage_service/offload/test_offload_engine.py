"""DLO engine on the CPU: block discovery, exact equality with the resident model, host bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from stagemesh.stage_service.models.config import DiTConfig
from stagemesh.stage_service.models.dit import DiT
from stagemesh.stage_service.offload import LayerwiseOffload, OffloadPlan, discover

CFG = DiTConfig(hidden_size=32, num_heads=2, cond_dim=16, decoder_channels=8)


def _dit(depth: int, seed: int = 0) -> DiT:
    torch.manual_seed(seed)
    model = DiT(DiTConfig(**{**CFG.__dict__, "depth": depth})).eval()
    # Non-trivial values everywhere (zero-initialised parameters would hide a wrong binding).
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.requires_grad_(False)


def _inputs(seed: int, batch: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, 4, 8, 8, generator=g),
        torch.rand(batch, generator=g),
        torch.randn(batch, 5, 16, generator=g),
    )


def _run(model: nn.Module, iterations: int = 3) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(*_inputs(k)) for k in range(iterations)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


# ---- discovery ---------------------------------------------------------------------------


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))


class _Unnamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))
        self.stack = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.mixed = nn.ModuleList([nn.Linear(64, 64), nn.Conv1d(64, 64, 3)])


def test_discovery_uses_the_declared_plan():
    found = discover(_dit(3))
    assert found.source == "plan"
    assert [b.path for b in found.blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [b.path for b in found.resident_candidates()] == ["blocks.0", "blocks.1", "blocks.2"]


def test_discovery_falls_back_to_attribute_names_then_the_heuristic():
    found = discover(_Layers())
    assert found.source == "attributes" and [b.path for b in found.blocks] == ["layers.0", "layers.1", "layers.2"]
    found = discover(_Unnamed())
    # The biggest list of same-type blocks; the mixed list is not a block list.
    assert found.source == "heuristic" and [b.path for b in found.blocks] == ["stack.0", "stack.1", "stack.2"]
    assert found.resident_candidates() == []


def test_plan_given_explicitly_wins_and_is_validated():
    model = _Unnamed()
    found = discover(model, OffloadPlan(block_attrs={"": ("small",)}, offload_submodules={"mixed": "0"}))
    assert [b.path for b in found.blocks] == [f"small.{i}" for i in range(5)] + ["mixed.0"]
    with pytest.raises(ValueError, match="nope"):
        discover(model, OffloadPlan(block_attrs={"": ("nope",)}))
    with pytest.raises(ValueError, match="overlap"):
        discover(model, OffloadPlan(block_attrs={"": ("stack",)}, offload_submodules=("stack.1",)))
    plan = OffloadPlan(block_attrs={"transformer": "blocks"})
    assert plan.block_attrs["transformer"] == ("blocks",)
    with pytest.raises(TypeError):
        plan.block_attrs["x"] = ("y",)  # type: ignore[index]


# ---- exact equality ----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3, 7, 70])
def test_output_equals_the_resident_model(depth: int):
    model = _dit(depth)
    want = _run(copy.deepcopy(model))
    engine = LayerwiseOffload(model, "cpu")
    assert _same(_run(model), want)
    stats = engine.stats()
    assert stats.streamed_blocks == depth and stats.host_mode == "packed"
    assert stats.host_bytes <= 1.05 * _model_bytes(model)
    assert stats.host_bytes <= 1.05 * stats.payload_bytes
    # Two slots, each the size of the largest block.
    assert stats.slot_bytes == 2 * max(layout.nbytes for layout in engine.layouts)
    # 1 warm-up + one per block per iteration, except blocks that never leave a slot.
    assert engine.transfers == (depth if depth <= 2 else 1 + 3 * depth)


@pytest.mark.parametrize("resident", [1, 3])
def test_resident_leading_layers(resident: int):
    model = _dit(5)
    want = _run(copy.deepcopy(model))
    engine = LayerwiseOffload(model, "cpu", resident_layers=resident)
    assert [b.path for b in engine.resident] == [f"blocks.{i}" for i in range(resident)]
    assert engine.stats().streamed_blocks == 5 - resident
    assert _same(_run(model), want)


def test_resident_layers_without_declared_paths_warn_and_stream_everything():
    model = _Layers()
    with capture_logs() as logs:
        engine = LayerwiseOffload(model, "cpu", resident_layers=2)
    assert engine.resident == [] and engine.stats().streamed_blocks == 3
    assert any("resident layers ignored" in e["event"] and e["log_level"] == "warning" for e in logs)
    with pytest.raises(ValueError, match=">= 0"):
        LayerwiseOffload(_Layers(), "cpu", resident_layers=-1)


def test_blocks_compute_from_the_slots_and_the_host_copy_is_what_streams():
    model = _dit(3)
    engine = LayerwiseOffload(model, "cpu")
    spans = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in engine._slots]
    seen = []

    def check(module, args):
        ptr = module.attn.q.weight.data_ptr()
        seen.append(any(lo <= ptr < hi for lo, hi in spans))

    for block in model.blocks:
        block.register_forward_pre_hook(check)  # runs after the engine's own pre-hook
    before = _run(model, 1)
    assert seen and all(seen)
    for buf in engine.store.buffers:
        buf.tensor.zero_()
    # The same input again: blocks now come from the zeroed host copy, so the output changes.
    assert not _same(_run(model, 1), before)


def test_blocks_run_out_of_the_predicted_order():
    class Shuffled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            order = [0, 1, 2, 3, 4] if self.calls % 2 else [4, 2, 0, 3, 1, 2]
            for i in order:
                x = torch.tanh(self.blocks[i](x))
            return x

    torch.manual_seed(1)
    model = Shuffled()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 8)
    LayerwiseOffload(model, "cpu")
    with torch.inference_mode():
        assert all(torch.equal(model(x), ref(x)) for _ in range(5))


@pytest.mark.parametrize("background", [False, True])
def test_staged_source_streams_through_two_bounded_buffers(background: bool):
    model = _dit(7)
    want = _run(copy.deepcopy(model))
    engine = LayerwiseOffload(model, "cpu", keep_source=True, background_staging=background)
    assert _same(_run(model), want)
    stats = engine.stats()
    assert stats.host_mode == "staged"
    assert stats.host_bytes == 2 * max(layout.nbytes for layout in engine.layouts)
    engine.close()


def _mapped(model: nn.Module, path) -> nn.Module:
    """`model` with every tensor viewing one safetensors file mapped read-only (as a runtime-cache
    entry is)."""
    from safetensors.torch import save_file

    from stagemesh.weight_store.checkpoint import map_tensors

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    model.load_state_dict(map_tensors(path), assign=True)
    return model


def test_a_locked_mapping_is_copied_from_directly_and_unlocked_once(tmp_path, monkeypatch):
    # No CUDA device here: the page lock itself is replaced by a recorder; the copies are real.
    from stagemesh.stage_service import platform

    locked, unlocked = [], []

    def lock(tensor, device):
        locked.append(tensor.untyped_storage().data_ptr())
        return lambda: unlocked.append(True)

    monkeypatch.setattr(platform, "lock_pages_in_place", lock)
    model = _mapped(_dit(5), tmp_path / "entry.safetensors")
    want = _run(copy.deepcopy(model))
    engine = LayerwiseOffload(model, "cpu", keep_source=True)
    assert engine.stats().host_mode == "locked"
    assert engine.stats().host_bytes == 0  # no staging buffers, no private copy
    assert len(locked) == 1  # one file, one mapping, locked once
    assert _same(_run(model), want)
    engine.close()
    engine.store.close()
    engine.store.close()
    assert unlocked == [True]


def test_a_mapping_the_driver_will_not_lock_is_staged(tmp_path, monkeypatch):
    from stagemesh.stage_service import platform

    monkeypatch.setattr(platform, "lock_pages_in_place", lambda tensor, device: None)
    model = _mapped(_dit(3), tmp_path / "entry.safetensors")
    want = _run(copy.deepcopy(model))
    engine = LayerwiseOffload(model, "cpu", keep_source=True)
    assert engine.stats().host_mode == "staged"
    assert _same(_run(model), want)


def test_meta_blocks_are_materialised_one_at_a_time():
    reference = _dit(3)
    with torch.device("meta"):
        model = DiT(reference.config)
    # Non-block tensors come from the reference; blocks are filled by init_block on demand.
    state = {k: v for k, v in reference.state_dict().items() if not k.startswith("blocks.")}
    model.load_state_dict(state, strict=False, assign=True)
    done = []

    def init_block(block: nn.Module) -> None:
        index = next(i for i, b in enumerate(model.blocks) if b is block)
        block.to_empty(device="cpu")
        block.load_state_dict(reference.blocks[index].state_dict())
        done.append(index)

    LayerwiseOffload(model.requires_grad_(False), "cpu", init_block=init_block)
    assert done == [0, 1, 2]
    assert _same(_run(model), _run(reference))


def test_close_removes_the_hooks_and_restores_the_host_copy():
    model = _dit(3)
    want = _run(copy.deepcopy(model))
    engine = LayerwiseOffload(model, "cpu")
    engine.close()
    assert _same(_run(model), want)
    assert all(not b._forward_pre_hooks for b in model.blocks)


def test_tied_weights_across_blocks_are_refused():
    model = _Layers()
    model.layers[1].weight = model.layers[0].weight
    with pytest.raises(ValueError, match="share a tensor"):
        LayerwiseOffload(model, "cpu")


def test_a_third_party_model_runs_unchanged():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = (
        diffusers.FluxTransformer2DModel(
            patch_size=1,
            in_channels=8,
            num_layers=2,
            num_single_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            pooled_projection_dim=8,
            guidance_embeds=True,
            axes_dims_rope=(2, 2, 4),
        )
        .eval()
        .requires_grad_(False)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    ref = copy.deepcopy(model)
    engine = LayerwiseOffload(model, "cpu")
    assert engine.discovery.source == "attributes"
    assert engine.stats().streamed_blocks == 5
    g = torch.Generator().manual_seed(3)
    kwargs = dict(
        hidden_states=torch.randn(1, 16, 8, generator=g),
        encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
        pooled_projections=torch.randn(1, 8, generator=g),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(6, 3),
        return_dict=False,
    )
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(model(**kwargs)[0], ref(**kwargs)[0])

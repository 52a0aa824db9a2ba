"""SleepController on the real tiny model, on the CPU: what sleeping and waking do to the weights.

No server here (docs/ARCHITECTURE.md: domain logic is tested without one). The models come from the same
loaders the workers use, and the weight sources are the runners' own `weight_files()`.
"""

from __future__ import annotations

import errno
import mmap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stagemesh.core.params import Params
from stagemesh.stage_service.models.contract import WeightFile
from stagemesh.stage_service.models.runners import ArRunner, DiffusionRunner, WorkItem
from stagemesh.stage_service.models.weights import DIT_FILE
from stagemesh.stage_service.worker.sleep import SleepController

ALIGN = 64
PIECE = 4 * mmap.PAGESIZE  # small pieces: the tiny model's weights span dozens of them


@pytest.fixture
def ar(tiny_model) -> ArRunner:
    return ArRunner(tiny_model, "cpu")


@pytest.fixture
def diffusion(tiny_model) -> DiffusionRunner:
    return DiffusionRunner(tiny_model, "cpu")


# ---- helpers --------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _snapshot(files: list[WeightFile]) -> dict[str, tuple[torch.dtype, tuple, bytes]]:
    """Every tensor the controller manages (persistent and non-persistent), by name, as raw bits."""
    out = {}
    for wf in files:
        for prefix, module in wf.parts.items():
            for name, t in module.state_dict().items():
                out[prefix + name] = (t.dtype, tuple(t.shape), _bits(t))
            for name, t in module.named_buffers():
                out[f"buffer:{prefix}{name}"] = (t.dtype, tuple(t.shape), _bits(t))
    return out


def _tensor_objects(files: list[WeightFile]) -> list[torch.Tensor]:
    return [t for wf in files for m in wf.parts.values() for t in [*m.parameters(), *m.buffers()]]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _expected_host_bytes(files: list[WeightFile]) -> int:
    sizes = []
    for wf in files:
        for module in wf.parts.values():
            persistent = module.state_dict(keep_vars=True)
            ids = {id(t) for t in persistent.values()}
            tensors = [*persistent.values(), *(b for _, b in module.named_buffers() if id(b) not in ids)]
            sizes += [t.numel() * t.element_size() for t in tensors]
    return _aligned(sum(_aligned(n) for n in sizes))


def _ar_output(ar: ArRunner) -> torch.Tensor:
    return ar.run([WorkItem("r", Params("a red fox in snow", 0, 0, 0, 0.0, 0, "tensor"))])[0]["hidden_states"]


def _image(diffusion: DiffusionRunner, cond: torch.Tensor, seed: int = 11) -> torch.Tensor:
    item = WorkItem("r", Params("p", 64, 48, 3, 4.0, seed, "tensor"), {"hidden_states": cond})
    return diffusion.run([item])[0]["image"]


def _fixed_cond(diffusion: DiffusionRunner) -> torch.Tensor:
    return torch.randn(6, diffusion.config.dit.cond_dim, generator=torch.Generator().manual_seed(3))


def _assert_all_released(files: list[WeightFile], keep: tuple[torch.Tensor, ...] = ()) -> None:
    for t in _tensor_objects(files):
        if any(t is k for k in keep):
            continue
        assert t.numel() == 0 and t.untyped_storage().nbytes() == 0, t.shape


# ---- round trips ----------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [1, 2])
def test_diffusion_round_trip_restores_bits_objects_and_samples(diffusion, level):
    files = diffusion.weight_files()
    cond = _fixed_cond(diffusion)
    image_before = _image(diffusion, cond)
    state_before = _snapshot(files)
    objects_before = _tensor_objects(files)
    controller = SleepController(files, "cpu")

    slept = controller.sleep(level)
    assert (slept.level, controller.level) == (level, level)
    assert slept.freed_bytes >= controller.weight_bytes > 0
    assert slept.latency_ms >= 0
    _assert_all_released(files)
    with pytest.raises(RuntimeError):
        _image(diffusion, cond)  # the weights really are gone, not merely flagged

    woken = controller.wake()
    assert (woken.level, controller.level) == (level, 0)
    assert woken.freed_bytes >= controller.weight_bytes  # on the CPU: storage bytes taken back
    assert _snapshot(files) == state_before
    after = _tensor_objects(files)
    assert len(after) == len(objects_before) and all(a is b for a, b in zip(after, objects_before))
    assert all(isinstance(p, torch.nn.Parameter) for m in files[0].parts.values() for p in m.parameters())
    assert _bits(_image(diffusion, cond)) == _bits(image_before)


@pytest.mark.parametrize("level", [1, 2])
def test_ar_round_trip_gives_the_same_hidden_states(ar, level):
    files = ar.weight_files()
    before = _ar_output(ar)
    state_before = _snapshot(files)
    params_before = list(ar.lm.parameters())
    controller = SleepController(files, "cpu")
    controller.sleep(level)
    _assert_all_released(files)
    controller.wake()
    assert _snapshot(files) == state_before
    assert all(a is b for a, b in zip(ar.lm.parameters(), params_before, strict=True))
    assert _bits(_ar_output(ar)) == _bits(before)


def test_alternating_levels_keep_the_output_over_many_cycles(diffusion):
    files = diffusion.weight_files()
    cond = _fixed_cond(diffusion)
    image_before = _bits(_image(diffusion, cond, seed=5))
    state_before = _snapshot(files)
    controller = SleepController(files, "cpu")
    for cycle in range(6):
        controller.sleep(1 + cycle % 2)
        controller.wake()
    assert _snapshot(files) == state_before
    assert _bits(_image(diffusion, cond, seed=5)) == image_before


# ---- the level-1 host buffer ----------------------------------------------------------------------
def test_level_1_host_buffer_is_exact_and_reused_across_cycles(diffusion):
    files = diffusion.weight_files()
    controller = SleepController(files, "cpu")
    expected = _expected_host_bytes(files)
    assert expected % ALIGN == 0 and expected >= controller.weight_bytes
    controller.sleep(1)
    assert controller.host_bytes == expected
    host = controller._host.tensor  # the buffer itself is under test
    assert host.dtype == torch.uint8 and host.numel() == expected
    pointer = host.data_ptr()
    controller.wake()
    for _ in range(3):
        controller.sleep(1)
        assert controller._host.tensor.data_ptr() == pointer and controller.host_bytes == expected
        controller.wake()


@pytest.mark.parametrize("mode", ["at_start", "background"])
def test_a_buffer_prepared_ahead_is_held_from_the_start_and_kept_at_every_level(diffusion, mode):
    files = diffusion.weight_files()
    state_before = _snapshot(files)
    expected = _expected_host_bytes(files)
    controller = SleepController(files, "cpu", host_buffer=mode, piece_bytes=PIECE)
    assert controller.host_bytes == expected  # held before any sleep
    pieces = controller._host.pieces.pieces
    if mode == "at_start":
        assert len(pieces) > 1 and all(p.ready.is_set() for p in pieces)  # prepared before it returned
    pointer = controller._host.tensor.data_ptr()
    controller.sleep(1)
    assert controller._host.tensor.data_ptr() == pointer  # the first sleep used it
    controller.wake()
    controller.sleep(1)
    controller.sleep(2)  # deeper: the buffer stays, as it would at start
    assert controller.host_bytes == expected and controller._host.tensor.data_ptr() == pointer
    controller.wake()
    assert _snapshot(files) == state_before
    controller.close()
    assert controller.host_bytes == 0


class _Holder:
    """Device memory a runner hands over (the DLO slots, captured graphs): released and restored."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def release_device(self) -> int:
        self.calls.append("release")
        return 0

    def restore_device(self) -> int:
        self.calls.append("restore")
        return 0


def test_compact_moves_the_weights_into_one_allocation_and_is_done_once(diffusion):
    files = diffusion.weight_files()
    state_before = _snapshot(files)
    controller = SleepController(files, "cpu", host_buffer="at_start", piece_bytes=PIECE)
    storages = {t.untyped_storage().data_ptr() for t in _tensor_objects(files)}
    assert len(storages) > 1  # as the loader left them
    objects = [id(t) for t in _tensor_objects(files)]
    holder = _Holder()
    controller.compact([holder])
    assert holder.calls == ["release", "restore"] and controller.level == 0
    assert len({t.untyped_storage().data_ptr() for t in _tensor_objects(files)}) == 1
    assert [id(t) for t in _tensor_objects(files)] == objects  # the same Parameter objects
    assert _snapshot(files) == state_before
    assert controller.last_sleep_phases.keys() == {"copy_s", "release_s"}
    flat = controller._device_flat
    controller.compact([holder])  # already one allocation: nothing happens
    assert controller._device_flat is flat and holder.calls == ["release", "restore"]
    controller.sleep(1)
    controller.compact([holder])  # asleep: nothing happens, the stage stays asleep
    assert controller.level == 1 and holder.calls == ["release", "restore"]
    controller.wake()
    assert _snapshot(files) == state_before
    controller.close()


def test_first_sleep_mode_holds_nothing_until_a_level_1_sleep(diffusion):
    files = diffusion.weight_files()
    expected = _expected_host_bytes(files)
    controller = SleepController(files, "cpu")
    assert controller.host_bytes == 0
    controller.sleep(2)
    controller.wake()
    assert controller.host_bytes == 0  # level 2 needs no host copy
    controller.sleep(1)
    assert controller.host_bytes == expected


@pytest.mark.parametrize("level", [1, 2])
def test_weights_split_across_many_pieces_round_trip_bit_exactly(diffusion, level):
    files = diffusion.weight_files()
    cond = _fixed_cond(diffusion)
    image_before = _bits(_image(diffusion, cond))
    state_before = _snapshot(files)
    controller = SleepController(files, "cpu", piece_bytes=PIECE)
    assert controller._total > 20 * PIECE  # most tensors cross a piece edge somewhere
    for _ in range(2):  # the first sleep copies tensor by tensor, later ones the one flat buffer
        controller.sleep(level)
        _assert_all_released(files)
        controller.wake()
        assert _snapshot(files) == state_before
    assert _bits(_image(diffusion, cond)) == image_before


def test_a_host_buffer_that_cannot_be_prepared_fails_the_sleep_and_leaves_the_stage_awake(diffusion, monkeypatch):
    # Running out of host memory cannot be provoked safely here: the fault-in reports it instead.
    from stagemesh.stage_service import platform

    files = diffusion.weight_files()
    state_before = _snapshot(files)
    controller = SleepController(files, "cpu", piece_bytes=PIECE)
    real_fault_in = platform.fault_in

    def out_of_memory(tensor):
        raise OSError(errno.ENOMEM, "cannot fault in host memory")

    monkeypatch.setattr(platform, "fault_in", out_of_memory)
    with pytest.raises(OSError, match="cannot fault in"):
        controller.sleep(1)
    assert controller.level == 0 and controller.host_bytes == 0  # nothing freed, nothing held
    assert _snapshot(files) == state_before
    monkeypatch.setattr(platform, "fault_in", real_fault_in)
    controller.sleep(1)  # a fresh buffer this time
    controller.wake()
    assert _snapshot(files) == state_before


def test_bad_host_buffer_options_are_refused(diffusion):
    files = diffusion.weight_files()
    with pytest.raises(ValueError, match="first_sleep, at_start, background"):
        SleepController(files, "cpu", host_buffer="eager")
    with pytest.raises(ValueError, match="multiple of"):
        SleepController(files, "cpu", piece_bytes=PIECE + 1)


def test_level_1_then_level_2_drops_the_host_copy_and_reloads_from_the_checkpoint(diffusion):
    files = diffusion.weight_files()
    cond = _fixed_cond(diffusion)
    image_before = _bits(_image(diffusion, cond))
    state_before = _snapshot(files)
    controller = SleepController(files, "cpu")
    controller.sleep(1)
    assert controller._host is not None
    deeper = controller.sleep(2)
    assert controller.level == 2 and deeper.freed_bytes == 0  # nothing left on the device to free
    assert controller._host is None  # the host copy is gone
    again = controller.sleep(1)  # shallower than where it is: no-op, it stays at level 2
    assert controller.level == 2 and again.freed_bytes == 0 and controller._host is None
    woken = controller.wake()
    assert woken.level == 2
    assert _snapshot(files) == state_before
    assert _bits(_image(diffusion, cond)) == image_before


def test_wake_while_awake_is_a_no_op(diffusion):
    files = diffusion.weight_files()
    controller = SleepController(files, "cpu")
    pointers = [t.data_ptr() for t in _tensor_objects(files)]
    state_before = _snapshot(files)
    result = controller.wake()
    assert (result.level, result.freed_bytes, controller.level) == (0, 0, 0)
    assert [t.data_ptr() for t in _tensor_objects(files)] == pointers
    assert _snapshot(files) == state_before


def test_level_3_is_refused_without_touching_the_weights(diffusion):
    files = diffusion.weight_files()
    controller = SleepController(files, "cpu")
    state_before = _snapshot(files)
    with pytest.raises(ValueError, match="1 or 2"):
        controller.sleep(3)
    assert controller.level == 0 and _snapshot(files) == state_before


# ---- level 2 reload from a checkpoint that does not fit -----------------------------------------
def _broken_checkpoint(tmp_path: Path, tiny_model: Path, edit) -> Path:
    tensors = load_file(str(tiny_model / DIT_FILE))
    key = edit(tensors)
    path = tmp_path / "broken.safetensors"
    save_file(tensors, str(path))
    return path, key


def _drop_one(tensors: dict) -> str:
    key = min(k for k in tensors if k.startswith("dit."))
    del tensors[key]
    return key


def _reshape_one(tensors: dict) -> str:
    key = next(k for k in sorted(tensors) if tensors[k].dim() == 2 and tensors[k].shape[0] != tensors[k].shape[1])
    tensors[key] = tensors[key].t().contiguous()
    return key


@pytest.mark.parametrize("edit, words", [(_drop_one, "lacks"), (_reshape_one, "the model holds")])
def test_level_2_wake_from_a_mismatched_checkpoint_names_the_key(tmp_path, tiny_model, diffusion, edit, words):
    path, key = _broken_checkpoint(tmp_path, tiny_model, edit)
    files = [WeightFile(path, diffusion.weight_files()[0].parts)]
    controller = SleepController(files, "cpu")
    controller.sleep(2)
    with pytest.raises(ValueError) as raised:
        controller.wake()
    assert key in str(raised.value) and words in str(raised.value)
    assert controller.level == 2  # still asleep: a failed wake does not claim the weights are back
    _assert_all_released(files)


# ---- non-persistent buffers -----------------------------------------------------------------------
def _add_buffer(diffusion: DiffusionRunner) -> torch.Tensor:
    """A non-persistent buffer (like rotary frequencies): not in the checkpoint, cannot be reloaded."""
    diffusion.dit.register_buffer("freqs", torch.linspace(0.0, 1.0, 40), persistent=False)
    return diffusion.dit.freqs


def test_non_persistent_buffers_survive_level_2(diffusion):
    buffer = _add_buffer(diffusion)
    files = diffusion.weight_files()
    assert "freqs" not in diffusion.dit.state_dict()
    values = buffer.clone()
    state_before = _snapshot(files)
    controller = SleepController(files, "cpu")
    assert controller.weight_bytes == sum(t.numel() * t.element_size() for t in _tensor_objects(files))
    slept = controller.sleep(2)
    assert diffusion.dit.freqs is buffer and torch.equal(buffer, values)  # kept while asleep
    _assert_all_released(files, keep=(buffer,))
    assert slept.freed_bytes >= controller.weight_bytes - buffer.numel() * buffer.element_size()
    controller.wake()
    assert diffusion.dit.freqs is buffer and torch.equal(buffer, values)
    assert _snapshot(files) == state_before


def test_non_persistent_buffers_round_trip_level_1(diffusion):
    buffer = _add_buffer(diffusion)
    files = diffusion.weight_files()
    values = buffer.clone()
    controller = SleepController(files, "cpu")
    controller.sleep(1)
    assert buffer.numel() == 0  # level 1 moves everything, buffers included, to the host copy
    controller.wake()
    assert diffusion.dit.freqs is buffer and torch.equal(buffer, values)


def test_level_2_after_a_level_1_cycle_releases_the_shared_weight_buffer(diffusion):
    """After a level-1 wake every tensor lives in one flat buffer. A kept non-persistent buffer must
    not keep that whole buffer (all the weights) alive through a level-2 sleep."""
    buffer = _add_buffer(diffusion)
    files = diffusion.weight_files()
    values = buffer.clone()
    state_before = _snapshot(files)
    controller = SleepController(files, "cpu")
    controller.sleep(1)
    controller.wake()
    flat = diffusion.dit.freqs.untyped_storage().data_ptr()
    assert next(diffusion.dit.parameters()).untyped_storage().data_ptr() == flat  # one shared buffer
    controller.sleep(2)
    own = buffer.untyped_storage()
    assert own.data_ptr() != flat and own.nbytes() == buffer.numel() * buffer.element_size()
    assert torch.equal(buffer, values)
    controller.wake()
    assert _snapshot(files) == state_before

"""Sleep and wake of a DLO diffusion runner, on the CPU (sleep rule 4 in docs/ARCHITECTURE.md: DLO stages free their
device slots and resident layers).

Only the resident weights (everything but the streamed blocks, resident layers included) and the
engine's two device slots live on the device; sleep frees exactly those and wake brings them
back. The streamed blocks' host copies (packed buffers, or the checkpoint mapping) stay.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.runners import DiffusionRunner, WorkItem
from stagemesh.stage_service.models.weights import DIT_PREFIX
from stagemesh.stage_service.settings import DloOptions
from stagemesh.stage_service.worker.sleep import SleepController

STAGED = {"enable_dlo": True}
RESIDENT = {"enable_dlo": True, "dlo_use_allgather": False, "dlo_resident_layers": 1}
PACKED = {"enable_dlo": True, "dlo_checkpoint_mmap": False}  # ordinary loader: packed buffers
OPTIONS = {"staged": STAGED, "resident-1": RESIDENT, "packed": PACKED}


def _runner(tiny_model: Path, name: str) -> DiffusionRunner:
    return DiffusionRunner(tiny_model, "cpu", DloOptions(**OPTIONS[name]))


def _image(runner: DiffusionRunner, seed: int = 11) -> torch.Tensor:
    cond = torch.randn(6, runner.config.dit.cond_dim, generator=torch.Generator().manual_seed(3))
    item = WorkItem("r", Params("p", 64, 48, 3, 4.0, seed, "tensor"), {"hidden_states": cond})
    return runner.run([item])[0]["image"]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _split(runner: DiffusionRunner) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(resident, streamed) tensors by checkpoint name, non-persistent buffers included."""
    streamed_paths = tuple(f"{b.path}." for b in runner.offload.streamed)
    resident, streamed = {}, {}
    for prefix, module in ((DIT_PREFIX, runner.dit), ("decoder.", runner.decoder)):
        named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        for name, t in named.items():
            is_streamed = module is runner.dit and name.startswith(streamed_paths)
            (streamed if is_streamed else resident)[prefix + name] = t
    return resident, streamed


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _host_state(runner: DiffusionRunner) -> list[tuple[int, bytes]]:
    """Where the streamed blocks' host bytes live, and what they are."""
    store = runner.offload.store
    if runner.offload.host_mode == "staged":
        return [(src.data_ptr(), _bits(src)) for block in store.sources for _, src in block]
    return [(b.tensor.data_ptr(), _bits(b.tensor)) for b in store.buffers]


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_sleep_frees_slots_and_resident_weights_and_wake_restores_them(tiny_model, name, level):
    runner = _runner(tiny_model, name)
    before = _bits(_image(runner))
    resident, streamed = _split(runner)
    slots = runner.offload.stats().slot_bytes
    host = _host_state(runner)
    controller = SleepController(runner.weight_files(), "cpu")
    assert slots > 0 and controller.weight_bytes == _nbytes(resident.values())

    slept = controller.sleep(level, holders=runner.device_holders())
    assert slept.freed_bytes == controller.weight_bytes + slots  # measured, not assumed
    assert runner.offload.stats().slot_bytes == 0
    assert all(t.numel() == 0 for t in [*resident.values(), *streamed.values()])
    assert _host_state(runner) == host  # the streamed blocks' host copies stay (both levels)
    with pytest.raises(RuntimeError, match="released"):
        runner.offload.streamed[0].module(torch.zeros(1))  # its slot is gone, so is its hook's

    woken = controller.wake()
    assert woken.level == level and woken.freed_bytes >= controller.weight_bytes + slots
    assert runner.offload.stats().slot_bytes == slots
    after_resident, after_streamed = _split(runner)
    assert all(after_resident[k] is t for k, t in resident.items())  # same Parameter objects
    assert all(after_streamed[k] is t for k, t in streamed.items())
    assert _bits(_image(runner)) == before


def test_resident_layers_are_managed_by_sleep(tiny_model):
    runner = _runner(tiny_model, "resident-1")
    files = runner.weight_files()
    block0 = runner.dit.blocks[0]
    assert runner.offload.stats().resident_blocks == 1
    keys = [DIT_PREFIX + k for k in runner.dit.state_dict()]
    managed = {k.split(".")[2] for k in keys if k.startswith("dit.blocks.") and files[0].manages(k)}
    assert managed == {"0"}  # block 0 stays on the device, so sleep frees it; 1.. stream
    controller = SleepController(files, "cpu")
    controller.sleep(2, holders=runner.device_holders())
    assert all(p.numel() == 0 for p in block0.parameters())
    controller.wake()
    assert all(p.numel() > 0 for p in block0.parameters())


def test_deeper_sleep_and_many_cycles_keep_the_output(tiny_model):
    runner = _runner(tiny_model, "staged")
    before = _bits(_image(runner, seed=5))
    controller = SleepController(runner.weight_files(), "cpu")
    slots = runner.offload.stats().slot_bytes
    controller.sleep(1, holders=runner.device_holders())
    deeper = controller.sleep(2, holders=runner.device_holders())  # slots are already gone
    assert (controller.level, deeper.freed_bytes) == (2, 0)
    assert controller.wake().level == 2 and runner.offload.stats().slot_bytes == slots
    for cycle in range(4):
        controller.sleep(1 + cycle % 2, holders=runner.device_holders())
        controller.wake()
    assert runner.offload.stats().slot_bytes == slots
    assert _bits(_image(runner, seed=5)) == before


def test_without_dlo_every_weight_is_managed_and_nothing_else_sleeps(tiny_model):
    runner = DiffusionRunner(tiny_model, "cpu")
    assert runner.device_holders() == [] and runner.weight_files()[0].skip == ()
    controller = SleepController(runner.weight_files(), "cpu")
    everything = [
        *runner.dit.parameters(),
        *runner.dit.buffers(),
        *runner.decoder.parameters(),
        *runner.decoder.buffers(),
    ]
    assert controller.weight_bytes == _nbytes(everything)

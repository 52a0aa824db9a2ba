"""LoRA adapters on a CUDA device (tiny random-weight FLUX folder): an adapter's low-rank weights
live on the device while it is in use and in host memory once the device bound moves it out; under
DLO (blocks streamed through the device slots) the image with an adapter equals the resident
model's; sleep gives the adapters' device memory back and wake takes it again."""

from __future__ import annotations

import pytest
import torch

from stagemesh.core.params import AdapterChoice, Params
from stagemesh.stage_service.models.contract import WorkItem

pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.gpu

CASE = ("a red fox", 32, 32, 2, 3.5, 1, "tensor")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from stagemesh.stage_service.models.adapters.synthetic import write_random_lora
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny

    root = tmp_path_factory.mktemp("adapters-gpu")
    flux = write_tiny(root / "flux", "flux")
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(flux / "transformer")
    write_random_lora(root / "loras" / "ink.safetensors", transformer, rank=4, seed=1)
    write_random_lora(root / "loras" / "film.safetensors", transformer, rank=8, seed=2)
    return {"flux": flux, "loras": root / "loras"}


def _runner(folders, dlo: bool):
    from stagemesh.stage_service.models.adapters import AdapterRegistry
    from stagemesh.stage_service.models.runners import build_runner
    from stagemesh.stage_service.settings import DloOptions

    opts = DloOptions(enable_dlo=True, dlo_use_allgather=False) if dlo else None
    runner = build_runner("diffusion", folders["flux"], "cuda", dlo=opts)
    registry = AdapterRegistry(runner.pipe, runner.transformer, "cuda", str(folders["loras"]), max_device_adapters=1)
    registry.load_dir()
    return runner, registry


def _image(encoder, runner, registry, *adapters) -> torch.Tensor:
    params = Params(*CASE, adapters=tuple(AdapterChoice(n, s) for n, s in adapters))
    item = WorkItem("r", params)
    [item.inputs] = encoder.run([item])
    registry.apply(params.adapters)
    [out] = runner.run([item])
    return out["image"].cpu()


def _devices(runner, name: str) -> set[str]:
    return {p.device.type for n, p in runner.transformer.named_parameters() if f".lora_A.{name}." in n}


def test_the_bound_moves_adapters_between_device_and_host_and_dlo_gives_the_resident_image(folders):
    from stagemesh.stage_service.models.runners import build_runner

    encoder = build_runner("encoder", folders["flux"], "cuda")
    resident, on_resident = _runner(folders, dlo=False)
    streamed, on_streamed = _runner(folders, dlo=True)
    for adapters in ((("ink", 0.8),), (("film", 1.5),), ()):
        want = _image(encoder, resident, on_resident, *adapters)
        assert torch.equal(_image(encoder, streamed, on_streamed, *adapters), want), adapters
    on_resident.apply((AdapterChoice("ink", 1.0),))
    assert _devices(resident, "ink") == {"cuda"} and _devices(resident, "film") == {"cpu"}
    on_resident.apply((AdapterChoice("film", 1.0),))
    assert _devices(resident, "ink") == {"cpu"} and _devices(resident, "film") == {"cuda"}


def test_sleep_gives_the_adapters_device_memory_back(folders):
    runner, registry = _runner(folders, dlo=False)
    registry.apply((AdapterChoice("film", 1.0),))
    on_device = sum(i.bytes for i in registry.infos() if i.on_device)
    every = sum(i.bytes for i in registry.infos())
    for level, released in ((1, on_device), (2, every)):
        sleeper = registry.for_sleep(level)
        assert sleeper.release_device() == released
        assert not _devices(runner, "film") - {"cpu"}
        sleeper.restore_device()
        assert _devices(runner, "film") == {"cuda"}

"""The first-image warm-up on the real runners of every stage kind that has one (the embedded
model's two, and a diffusers folder's encoder and diffusion stages, FLUX and SD3, whose inputs
the warm-up shapes as the encoder stage sends them), in process on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stagemesh.core import startup
from stagemesh.stage_service.models.diffusers_adapter import synthetic
from stagemesh.stage_service.models.runners import build_runner
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.worker.warm_up import WarmUpFailed, params_of, wanted, warm_up


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("warm-up")
    return {family: synthetic.write_tiny(root / family, family) for family in ("flux", "sd3")}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def warm_phases() -> list[dict]:
    return [p for p in startup.records() if p["phase"] == "warm-up"]


def settings(kind: str, **kw) -> StageSettings:
    return StageSettings(kind=kind, warm_up="on", default_size=32, **kw)


@pytest.mark.parametrize("family", ["flux", "sd3"])
@pytest.mark.parametrize("kind", ["encoder", "diffusion", "denoise"])
def test_diffusers_runners_warm_up(folders, family, kind):
    startup.begin("test")
    runner = build_runner(kind, folders[family])
    warm_up(runner, settings(kind), "cpu")
    [phase] = warm_phases()
    assert (phase["size"], phase["steps"]) == (32, 2) and "failed" not in phase


@pytest.mark.parametrize("kind", ["ar", "diffusion"])
def test_embedded_runners_warm_up(tiny_model, kind):
    startup.begin("test")
    runner = build_runner(kind, tiny_model)
    warm_up(runner, settings(kind), "cpu")
    assert len(warm_phases()) == 1


def test_the_warm_up_runs_what_a_request_leaving_everything_unset_asks(tiny_model):
    runner = build_runner("diffusion", tiny_model)
    params = params_of(StageSettings(kind="diffusion", default_steps=8, default_guidance=2.5), runner)
    own = int(runner.limits()["native_size"]) if "native_size" in runner.limits() else params.width
    assert (params.width, params.height) == (own, own)
    assert (params.num_inference_steps, params.guidance_scale) == (2, 2.5)


def test_a_decode_stage_has_no_warm_up_and_says_so(folders, capsys):
    startup.begin("test")
    warm_up(build_runner("decode", folders["flux"]), settings("decode"), "cpu")
    assert warm_phases() == []
    logged = capsys.readouterr()
    assert "no warm-up for this stage kind" in logged.out + logged.err


def test_off_and_auto_on_the_cpu_run_nothing(tiny_model):
    assert not wanted(StageSettings(kind="ar", warm_up="off"), "cpu")
    assert not wanted(StageSettings(kind="ar", warm_up="auto"), "cpu")
    assert wanted(StageSettings(kind="ar", warm_up="on"), "cpu")


def test_a_size_off_the_pixel_multiple_fails_naming_it(folders):
    runner = build_runner("diffusion", folders["flux"])
    multiple = runner.limits()["pixel_multiple"]
    size = 8 * multiple + 2
    expected = f"default_size {size} is not a multiple of the model's pixel multiple {multiple}"
    with pytest.raises(WarmUpFailed, match=expected):
        warm_up(runner, StageSettings(kind="diffusion", warm_up="on", default_size=size), "cpu")


def test_an_unknown_warm_up_mode_is_refused_naming_the_allowed():
    with pytest.raises(ValueError, match="warm_up = 'always': allowed: auto, on, off"):
        StageSettings(kind="ar", warm_up="always")

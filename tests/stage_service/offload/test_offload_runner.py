"""DLO options of a stage and the diffusion runner under DLO."""

from __future__ import annotations

import argparse
import dataclasses
import math
import pickle
import re
from pathlib import Path

import pytest
import torch

from stagemesh import config as mesh_config
from stagemesh.core.params import Params
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.runners import WorkItem, build_runner
from stagemesh.stage_service.models.weights import ensure_model_dir
from stagemesh.stage_service.settings import DloOptions, StageSettings

# ---- options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"dlo_resident_layers": -1}, "dlo_resident_layers must be >= 0"),
        ({"dlo_resident_layers": 2}, "--dlo-no-use-allgather"),
        ({"dlo_enable_runtime_cache": True}, "dlo_enable_runtime_cache needs no-AllGather"),
        ({"dlo_runtime_cache_lock_timeout": 0}, "finite number of seconds > 0"),
        ({"dlo_runtime_cache_lock_timeout": -5.0}, "finite number of seconds > 0"),
        ({"dlo_runtime_cache_lock_timeout": math.inf}, "finite number of seconds > 0"),
        ({"dlo_runtime_cache_lock_timeout": math.nan}, "finite number of seconds > 0"),
        ({"dp_size": 0}, "dp_size must be >= 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"dlo_stream_dtype": "float8_e5m2"}, "dlo_stream_dtype must be one of ['', 'float8_e4m3fn', 'int8']"),
        ({"dlo_stream_dtype": "bfloat16"}, "dlo_stream_dtype must be one of"),
    ],
)
def test_refused_combinations_say_what_to_change(values: dict, needle: str):
    with pytest.raises(ValueError, match=re.escape(needle)):
        StageSettings(kind="diffusion", enable_dlo=True, **values)
    with pytest.raises(ValueError, match="must|needs"):
        DloOptions(enable_dlo=True, **values)


def test_accepted_combinations_and_flags(capsys):
    ok = StageSettings(
        kind="diffusion", enable_dlo=True, dlo_use_allgather=False, dlo_resident_layers=3, dlo_enable_runtime_cache=True
    )
    assert DloOptions.from_settings(ok).dlo_resident_layers == 3
    parser = argparse.ArgumentParser()
    StageSettings.add_arguments(parser)
    args = parser.parse_args(
        [
            "--enable-dlo",
            "--dp-size",
            "2",
            "--dlo-no-use-allgather",
            "--dlo-resident-layers",
            "4",
            "--dlo-runtime-cache-lock-timeout",
            "30",
            "--tensor-parallel-size",
            "1",
            "--dlo-stream-dtype",
            "float8_e4m3fn",
        ]
    )
    s = StageSettings.from_args(args)
    assert (s.enable_dlo, s.dp_size, s.dlo_use_allgather, s.dlo_resident_layers, s.dlo_runtime_cache_lock_timeout) == (
        True,
        2,
        False,
        4,
        30.0,
    )
    assert s.dlo_stream_dtype == "float8_e4m3fn"
    assert not StageSettings.from_args(parser.parse_args(["--no-dlo-use-allgather"])).dlo_use_allgather
    assert StageSettings.from_args(parser.parse_args([])).dlo_use_allgather
    # The flags a supervisor passes on round-trip through the parser.
    again = StageSettings.from_args(parser.parse_args(s.to_flags()))
    assert DloOptions.from_settings(again) == DloOptions.from_settings(s)
    with pytest.raises(SystemExit) as refused:
        StageSettings.from_args(parser.parse_args(["--dlo-resident-layers", "2"]))
    assert refused.value.code == 2  # a usage error, as argparse's own
    assert "--dlo-no-use-allgather" in capsys.readouterr().err


def test_mesh_toml_keys(tmp_path: Path):
    path = tmp_path / "mesh.toml"
    path.write_text(
        '[[stages]]\nkind = "ar"\n[[stages]]\nkind = "diffusion"\nenable_dlo = true\n'
        "dlo_use_allgather = false\ndlo_resident_layers = 1\n"
    )
    stage = mesh_config.load(path).stages[1]
    assert stage.enable_dlo and stage.dlo_resident_layers == 1
    path.write_text('[[stages]]\nkind = "diffusion"\ndlo_resident_layers = 1\n')
    with pytest.raises(ValueError, match="--dlo-no-use-allgather"):
        mesh_config.load(path)
    fp8 = '[[stages]]\nkind = "ar"\n[[stages]]\nkind = "diffusion"\nenable_dlo = true\n'
    fp8 += 'dlo_stream_dtype = "float8_e4m3fn"\n'
    path.write_text(fp8)
    assert mesh_config.load(path).stages[1].dlo_stream_dtype == "float8_e4m3fn"
    path.write_text('[[stages]]\nkind = "diffusion"\ndlo_stream_dtype = "float8_e4m3fn"\n')
    with pytest.raises(ValueError, match="needs enable_dlo"):
        mesh_config.load(path)


def test_worker_spec_carries_the_options():
    settings = StageSettings(stage_id=1, kind="diffusion", model_dir="/m", enable_dlo=True)
    [group] = Executor(settings).groups
    spec = group.specs[0]
    # A spawned worker gets the settings whole, pickled, and builds its runner's options from them.
    assert pickle.loads(pickle.dumps(spec)) == spec and spec.settings == settings
    assert DloOptions.from_settings(spec.settings) == DloOptions(enable_dlo=True)
    ar = Executor(StageSettings(kind="ar", model_dir="/m")).groups[0].specs[0]
    assert DloOptions.from_settings(ar.settings) == DloOptions()


# ---- runner ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model_dir(tmp_path_factory.mktemp("dlo") / "tiny", PipelineConfig.tiny())


def _batch() -> list[WorkItem]:
    g = torch.Generator().manual_seed(0)
    return [
        WorkItem(
            f"r{i}", Params("p", 32, 48, 3, 4.0, i, "tensor"), {"hidden_states": torch.randn(5 + i, 64, generator=g)}
        )
        for i in range(2)
    ]


def _images(runner) -> list[torch.Tensor]:
    return [out["image"] for out in runner.run(_batch())]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_runner_with_dlo_equals_the_resident_runner(model_dir: Path):
    want = _images(build_runner("diffusion", model_dir))
    runner = build_runner("diffusion", model_dir, dlo=DloOptions(enable_dlo=True))
    stats = runner.offload.stats()
    # The checkpoint mapping stays open; blocks go through two staging buffers.
    assert stats.host_mode == "staged" and stats.streamed_blocks == runner.config.dit.depth
    assert _equal(_images(runner), want)
    resident = build_runner(
        "diffusion", model_dir, dlo=DloOptions(enable_dlo=True, dlo_use_allgather=False, dlo_resident_layers=1)
    )
    assert resident.offload.stats().resident_blocks == 1
    assert _equal(_images(resident), want)


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = dataclasses.replace(PipelineConfig.tiny(), dtype="bfloat16")
    return ensure_model_dir(tmp_path_factory.mktemp("dlo-bf16") / "tiny", config)


def _per_step(runner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the DiT's output at every denoising step, the images)."""
    steps: list[torch.Tensor] = []
    hook = runner.dit.register_forward_hook(lambda _m, _a, out: steps.append(out.float().clone()))
    try:
        return steps, _images(runner)
    finally:
        hook.remove()


def test_fp8_streaming_per_step_against_bf16(bf16_model_dir: Path):
    want, want_images = _per_step(build_runner("diffusion", bf16_model_dir, dlo=DloOptions(enable_dlo=True)))
    opts = DloOptions(enable_dlo=True, dlo_stream_dtype="float8_e4m3fn")
    runner = build_runner("diffusion", bf16_model_dir, dlo=opts)
    got, images = _per_step(runner)
    assert runner.offload.stats().stream_dtype == "float8_e4m3fn" and runner.offload.stats().host_mode == "packed"
    assert len(got) == len(want) == 3  # one DiT forward per step
    cosines = [float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)) for a, b in zip(got, want)]
    print(f"fp8 vs bf16 DiT output per step: cosine {[round(c, 6) for c in cosines]}")
    assert min(cosines) >= 0.995
    assert not _equal(images, want_images)  # the weights really were rounded to FP8
    for a, b in zip(images, want_images):
        assert float((a - b).abs().max()) < 0.05


def test_runner_falls_back_to_the_ordinary_loader(model_dir: Path):
    want = _images(build_runner("diffusion", model_dir))
    # Without the direct mmap plan: private host copies, packed once.
    runner = build_runner("diffusion", model_dir, dlo=DloOptions(enable_dlo=True, dlo_checkpoint_mmap=False))
    assert runner.offload.stats().host_mode == "packed"
    assert _equal(_images(runner), want)


def test_runner_refuses_allgather_without_a_group(model_dir: Path):
    with pytest.raises(ValueError, match="dp_size = 2 with AllGather"):
        build_runner("diffusion", model_dir, dlo=DloOptions(enable_dlo=True, dp_size=2))


def test_worker_processes_get_the_options_through_the_executor(model_dir: Path, capfd):
    """Real worker processes: the stage's DLO options reach the runner; same image either way."""
    item = _batch()[0]
    images, mapped = [], []
    for dlo in ({}, {"enable_dlo": True}):
        settings = StageSettings(
            stage_id=1, kind="diffusion", model_dir=str(model_dir), threads=1, step_execution=True, **dlo
        )
        ex = Executor(settings)
        try:
            ex.start(120)
            _, fut = ex.submit(0, [item])
            images.append(fut.result(120)[0]["image"])
        finally:
            ex.shutdown()
        out, err = capfd.readouterr()
        mapped.append("dlo mmap plan applied" in out + err)  # logged by the worker process
    assert mapped == [False, True]
    assert torch.equal(images[0], images[1])

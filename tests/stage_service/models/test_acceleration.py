"""The denoising-speed options on the CPU: their plumbing and refusals, the compile cache's key and
its reuse by a second process, compiled blocks surviving a level-1 sleep without a recompile, the
FP8 layers' quantisation (scales, layer selection, the matmul against its float32 reference).
Diffusers' step-cache hooks and compile under DLO, on a tiny FLUX folder, are in
test_acceleration_flux.py.

The FP8 matmul runs here through torch._scaled_mm's CPU kernel: its numbers, not its speed, are
what the GPU path computes. Whether compiled FP8 is fast is measured in bench/real_pipeline.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stagemesh.core.errors import InvalidArgument
from stagemesh.core.params import Limits, Params, resolve
from stagemesh.stage_service.models.acceleration import compile as regional
from stagemesh.stage_service.models.acceleration import fp8
from stagemesh.stage_service.models.contract import WeightFile
from stagemesh.stage_service.settings import StageSettings
from stagemesh.stage_service.worker.sleep import SleepController
from tests.support.compile_child import inputs, tiny_dit
from tests.support.meshproc import REPO

# ---- options ---------------------------------------------------------------------------------


def test_compile_auto_is_regional_on_a_cuda_denoising_stage_and_off_elsewhere():
    assert StageSettings(kind="diffusion").compile_mode() == "off"
    assert StageSettings(kind="diffusion", device="cuda").compile_mode() == "regional"
    assert StageSettings(kind="denoise", device="cuda:0").compile_mode() == "regional"
    assert StageSettings(kind="ar", device="cuda").compile_mode() == "off"
    assert StageSettings(kind="diffusion", compile="regional").compile_mode() == "regional"
    assert StageSettings(kind="diffusion", device="cuda", compile="off").compile_mode() == "off"
    tp = StageSettings(kind="diffusion", device="cuda", tensor_parallel_size=2, workers=2)
    assert tp.compile_mode() == "off"  # its blocks all-reduce inside: eager


def test_flags_and_mesh_keys_reach_the_settings():
    parser = argparse.ArgumentParser()
    StageSettings.add_arguments(parser)
    args = parser.parse_args(
        ["--kind", "diffusion", "--compile", "regional", "--step-cache", "first_block", "--step-cache-threshold", "0.2"]
    )
    settings = StageSettings.from_args(args)
    assert (settings.compile, settings.step_cache, settings.step_cache_threshold) == ("regional", "first_block", 0.2)
    # What `stagemesh up` hands the stage reads back the same.
    again = StageSettings.from_args(parser.parse_args(settings.to_flags()))
    assert again == settings
    table = StageSettings.from_mapping(
        {"kind": "diffusion", "device": "cuda", "compute_dtype": "float8", "fp8_backend": "torchao"}
    )
    assert (table.compute_dtype, table.fp8_backend, table.compile_mode()) == ("float8", "torchao", "regional")
    with pytest.raises(SystemExit):
        parser.parse_args(["--compile", "max-autotune"])  # not a choice


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"compile": "max"}, "compile = 'max': allowed: auto, regional, off"),
        ({"compute_dtype": "float16"}, "compute_dtype = 'float16': allowed: '' (the checkpoint's dtype) or 'float8'"),
        ({"compute_dtype": "float8"}, "compute_dtype = 'float8' on device = 'cpu'"),
        ({"compute_dtype": "float8", "device": "cuda", "compile": "off"}, "with compile = 'off'"),
        (
            {
                "compute_dtype": "float8",
                "device": "cuda",
                "enable_dlo": True,
                "dlo_use_allgather": False,
                "dlo_stream_dtype": "int8",
            },
            "with dlo_stream_dtype = 'int8'",
        ),
        (
            {"compute_dtype": "float8", "device": "cuda", "enable_dlo": True, "dlo_use_allgather": False},
            "compute_dtype = 'float8' with enable_dlo",
        ),
        (
            {"compile": "regional", "device": "cuda", "tensor_parallel_size": 2, "workers": 2},
            "compile = 'regional' with tensor_parallel_size = 2",
        ),
        ({"fp8_backend": "cublas"}, "fp8_backend = 'cublas': allowed: scaled_mm, torchao"),
        ({"step_cache": "teacache"}, "step_cache = 'teacache': allowed: off, first_block, taylorseer, mag"),
        ({"step_cache_threshold": -0.5}, "step_cache_threshold = -0.5: allowed: 0"),
        ({"step_cache": "mag", "sp_size": 2, "workers": 2}, "step_cache = 'mag' with sp_size = 2"),
        ({"kind": "ar", "step_cache": "first_block"}, "step_cache = 'first_block' on a 'ar' stage"),
        ({"kind": "encoder", "compile": "regional"}, "compile = 'regional' on a 'encoder' stage"),
    ],
)
def test_refused_combinations_name_what_to_change(values, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        StageSettings(**{"kind": "diffusion", **values})


def test_a_request_names_its_step_cache_and_it_splits_batches():
    limits = Limits(step_caches=("off", "first_block"))

    def params(**extra) -> Params:
        common = dict(prompt="p", width=16, height=16, num_inference_steps=4, guidance_scale=1.0, seed=1)
        return resolve(output_format="tensor", limits=limits, **common, **extra)

    plain, cached = params(), params(step_cache="first_block", step_cache_threshold=0.3)
    assert (cached.step_cache, cached.step_cache_threshold) == ("first_block", 0.3)
    # Different cache settings never share a batch (the engine compares batch keys).
    assert plain.batch_key() != cached.batch_key()
    assert cached.batch_key() != params(step_cache="first_block").batch_key()
    with pytest.raises(InvalidArgument) as refused:
        params(step_cache="mag", step_cache_threshold=-1.0)
    fields = {v.field: v.description for v in refused.value.violations}
    assert "allowed: unset (the stage's setting) or off, first_block" in fields["params.step_cache"]
    assert "allowed: unset (the stage's setting) or above 0" in fields["params.step_cache_threshold"]


def test_the_step_cache_fields_cross_the_wire():
    from stagemesh.core import converters

    p = resolve(
        prompt="p",
        width=16,
        height=16,
        num_inference_steps=4,
        guidance_scale=1.0,
        seed=1,
        output_format="png",
        limits=Limits(),
        step_cache="taylorseer",
        step_cache_threshold=3.0,
    )
    back = converters.params_from_proto(converters.params_to_proto(p), Limits())
    assert (back.step_cache, back.step_cache_threshold) == ("taylorseer", 3.0)
    unset = converters.params_from_proto(converters.params_to_proto(dataclasses.replace(p, step_cache=None)), Limits())
    assert unset.step_cache is None


# ---- the compile cache ---------------------------------------------------------------------------


def test_the_cache_key_changes_with_layout_and_options_only():
    model = tiny_dit()
    options = {"compile": "regional", "fullgraph": True}
    key = regional.cache_key(regional.key_material(model, "cpu", options))
    assert key == regional.cache_key(regional.key_material(tiny_dit(), "cpu", options))  # same layout
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # other values: the compiled code does not depend on them
    assert key == regional.cache_key(regional.key_material(model, "cpu", options))
    assert key != regional.cache_key(regional.key_material(tiny_dit(torch.bfloat16), "cpu", options))
    assert key != regional.cache_key(regional.key_material(model, "cpu", {**options, "compute_dtype": "float8"}))
    material = regional.key_material(model, "cpu", options)
    assert material["torch"] == torch.__version__
    assert key != regional.cache_key({**material, "torch": "0.0.0"})


def test_the_cache_directory_is_private_and_says_what_it_holds(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    material = regional.key_material(tiny_dit(), "cpu", {"compile": "regional"})
    path = regional.use_cache_dir(tmp_path / "root", material)
    assert path == tmp_path / "root" / regional.COMPILE_DIR / regional.cache_key(material)
    assert (path.stat().st_mode & 0o777) == 0o700
    assert json.loads((path / regional.KEY_FILE).read_text())["torch"] == torch.__version__
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path)


def _compile_in_a_process(root: Path, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.compile_child", str(root), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled_once(tmp_path_factory) -> dict:
    """One process's compile of the tiny DiT's blocks into an empty cache root: its counters. The
    compile (tens of seconds of C++ on the CPU) is done once for the tests below."""
    return _compile_in_a_process(tmp_path_factory.mktemp("compile-root"))


def test_a_second_process_loads_the_compiled_blocks_instead_of_compiling(compiled_once):
    # Another layout's own directory is test_the_cache_key_changes_with_layout_and_options_only's
    # and test_the_cache_directory_is_private_and_says_what_it_holds' to check.
    first = compiled_once
    assert first["fxgraph_cache_miss"] > 0 and first["fxgraph_cache_hit"] == 0
    second = _compile_in_a_process(Path(first["cache_dir"]).parents[1])
    assert second["cache_dir"] == first["cache_dir"]
    assert second["fxgraph_cache_hit"] > 0 and second["fxgraph_cache_miss"] == 0


def test_compiled_blocks_match_eager_and_survive_a_level_1_sleep_without_recompiling(
    compiled_once, tmp_path, monkeypatch
):
    # The blocks' code comes from compiled_once's cache (one thread, as that process ran): what is
    # checked here is the compiled forward's numbers and that a sleep leaves it compiled.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", compiled_once["cache_dir"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compiled_blocks_survive_a_level_1_sleep(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _compiled_blocks_survive_a_level_1_sleep(tmp_path: Path) -> None:
    eager, model = tiny_dit(), tiny_dit()
    save_file(model.state_dict(), tmp_path / "dit.safetensors")
    assert regional.compile_blocks(model) == len(model.blocks)
    assert regional.compile_blocks(model) == 0  # already compiled: left alone
    with torch.inference_mode():
        want = eager(*inputs())
        torch.testing.assert_close(model(*inputs()), want, rtol=1e-4, atol=1e-5)
    graphs = regional.compile_counters()["graphs"]
    # As a worker does: the control call runs outside the forward passes' inference mode.
    sleep = SleepController([WeightFile(tmp_path / "dit.safetensors", {"": model})], "cpu")
    before = [p.data_ptr() for p in model.parameters()]
    sleep.sleep(1)
    sleep.wake()
    assert before != [p.data_ptr() for p in model.parameters()]  # the weights moved
    with torch.inference_mode():
        torch.testing.assert_close(model(*inputs()), want, rtol=1e-4, atol=1e-5)
    assert regional.compile_counters()["graphs"] == graphs  # and nothing was compiled again
    sleep.close()


def test_a_model_without_repeated_blocks_is_refused_by_name():
    with pytest.raises(ValueError, match=re.escape("Linear declares no repeated blocks (_repeated_blocks)")):
        regional.compile_blocks(torch.nn.Linear(4, 4))


# ---- FP8 -----------------------------------------------------------------------------------------


def test_rows_are_scaled_so_their_largest_value_is_the_formats_largest():
    x = torch.tensor([[1.0, -3.0, 0.5], [0.0, 0.0, 0.0], [100.0, 2.0, -50.0]])
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    torch.testing.assert_close(scale[:, 0], torch.tensor([3.0, 1e-12, 100.0]) / fp8.FP8_MAX)
    assert q.float().abs().amax(dim=1)[[0, 2]].tolist() == [fp8.FP8_MAX, fp8.FP8_MAX]
    assert torch.equal(q[1].float(), torch.zeros(3))
    # e4m3 keeps 3 mantissa bits: every value within 1/16 of its own magnitude.
    y = torch.randn(64, 256)
    q, scale = fp8.quantize_rows(y)
    assert ((q.float() * scale - y).abs() <= y.abs() / 16 + 1e-6).all()


def test_only_linears_in_repeated_blocks_with_aligned_sizes_are_converted():
    model = tiny_dit()  # hidden 32, mlp 128: every block Linear is aligned
    names = [name for name, _ in fp8.selected_linears(model)]
    assert names and all(name.startswith("blocks.") for name in names)
    assert not any(name.startswith(("x_embed", "t_embed", "cond_embed", "final")) for name in names)
    block_linears = [m for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)]
    assert len(names) == len(block_linears)
    odd = torch.nn.Linear(32, 24)  # 24: not a multiple of 16
    model.blocks[0].add_module("odd", odd)
    assert "blocks.0.odd" not in [name for name, _ in fp8.selected_linears(model)]
    assert fp8.convert(model) == len(names)
    assert all(isinstance(model.get_submodule(n), fp8.Fp8Linear) for n in names)
    assert isinstance(model.blocks[0].odd, torch.nn.Linear)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # float32: the bias is added after the kernel
def test_an_fp8_layer_computes_its_reference_and_stays_close_to_the_original(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48).to(dtype)
    layer = fp8.Fp8Linear(linear)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (1, 48)
    x = torch.randn(3, 5, 64, dtype=dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (3, 5, 48)
    torch.testing.assert_close(got.float(), fp8.reference_linear(layer, x), rtol=2e-2, atol=2e-2)
    assert fp8.cosine(got, linear(x)) > 0.99


def test_torchao_fp8_refuses_weights_other_than_bfloat16_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match=re.escape("its per-row FP8 takes bfloat16 weights only")):
        fp8.convert(model, "torchao")


def test_fp8_compute_is_refused_on_the_cpu_by_name():
    with pytest.raises(ValueError, match=re.escape("compute_dtype = 'float8' on cpu: FP8 matmuls need a CUDA GPU")):
        fp8.check_device("cpu")

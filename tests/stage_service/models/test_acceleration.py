"""The denoising-speed options on the CPU: their plumbing and refusals, the compile cache's key and
its reuse by a second process, compiled blocks surviving a level-1 sleep without a recompile, the
FP8 layers' quantisation (scales, layer selection, the matmul against its float32 reference) and
diffusers' step-cache hooks switched per batch and counted on a tiny FLUX folder.

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
from stagemesh.core.params import STEP_CACHE_OUTPUT, STEP_CACHES, Limits, Params, resolve
from stagemesh.stage_service.models import acceleration
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


def test_a_second_process_loads_the_compiled_blocks_instead_of_compiling(tmp_path):
    first = _compile_in_a_process(tmp_path)
    assert first["fxgraph_cache_miss"] > 0 and first["fxgraph_cache_hit"] == 0
    second = _compile_in_a_process(tmp_path)
    assert second["cache_dir"] == first["cache_dir"]
    assert second["fxgraph_cache_hit"] > 0 and second["fxgraph_cache_miss"] == 0
    # Another layout compiles afresh, in a directory of its own.
    other = _compile_in_a_process(tmp_path, "bfloat16")
    assert other["cache_dir"] != first["cache_dir"] and other["fxgraph_cache_miss"] > 0


def test_compiled_blocks_match_eager_and_survive_a_level_1_sleep_without_recompiling(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
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


# ---- step caching --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    pytest.importorskip("diffusers")
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny
    from stagemesh.stage_service.models.runners import build_runner

    folder = write_tiny(tmp_path_factory.mktemp("flux") / "flux", "flux")
    return build_runner("encoder", folder), build_runner("diffusion", folder)


def _item(encoder, **params):
    from stagemesh.stage_service.models.runners import WorkItem

    item = WorkItem("r", Params("a red fox", 32, 32, 8, 3.5, 1, "tensor", **params))
    [item.inputs] = encoder.run([item])
    return item


def test_step_cache_skips_are_counted_per_batch_and_switch_with_the_request(flux):
    encoder, diffusion = flux
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        settings = StageSettings(kind="diffusion", step_cache="first_block", step_cache_threshold=0.5)
        accel = acceleration.prepare(diffusion, settings, "cpu")
        assert accel.limits() == {"step_caches": ["off", "first_block", "taylorseer", "mag"]}
        blocks = len(regional.repeated_blocks(diffusion.transformer))
        [plain] = accel.run(diffusion.run, [_item(encoder, step_cache="off")])
        assert STEP_CACHE_OUTPUT not in plain  # no cache ran: nothing to report
        [cached] = accel.run(diffusion.run, [_item(encoder)])  # the stage's own: first_block at 0.5
        skipped, passes, method = cached[STEP_CACHE_OUTPUT].tolist()
        assert STEP_CACHES[method] == "first_block" and passes == 8 * blocks
        # The head block always runs; a skipped step skips every other block.
        assert skipped > 0 and skipped % (blocks - 1) == 0
        assert not torch.equal(cached["image"], plain["image"])
        # A threshold of almost nothing skips nothing, and the image is the uncached one.
        [strict] = accel.run(diffusion.run, [_item(encoder, step_cache_threshold=1e-9)])
        assert strict[STEP_CACHE_OUTPUT].tolist()[0] == 0
        torch.testing.assert_close(strict["image"], plain["image"])
        [taylor] = accel.run(diffusion.run, [_item(encoder, step_cache="taylorseer", step_cache_threshold=2.0)])
        assert taylor[STEP_CACHE_OUTPUT].tolist()[0] > 0
        # The same request again counts the same: every batch starts from fresh hook state.
        [again] = accel.run(diffusion.run, [_item(encoder)])
        assert torch.equal(again[STEP_CACHE_OUTPUT], cached[STEP_CACHE_OUTPUT])
        assert torch.equal(again["image"], cached["image"])
        assert accel.step_cache_counts()[0] == skipped * 2 + taylor[STEP_CACHE_OUTPUT].tolist()[0]
        [back] = accel.run(diffusion.run, [_item(encoder, step_cache="off")])
        assert torch.equal(back["image"], plain["image"])  # hooks off: the eager result again
    finally:
        torch.set_num_threads(threads)


def test_a_model_declares_which_step_caches_it_offers():
    from stagemesh.stage_service.models.acceleration.step_cache import Choice, StepCache, offered

    assert offered(tiny_dit()) == ("off",)  # the embedded DiT: none
    pytest.importorskip("diffusers")
    from diffusers import SD3Transformer2DModel

    sd3 = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
    )
    assert offered(sd3) == ("off",)  # diffusers 0.42 gives SD3's transformer no cache hooks
    with pytest.raises(ValueError, match=re.escape("step_cache = 'first_block': SD3Transformer2DModel offers off")):
        StepCache(sd3, Choice("first_block"))


# ---- compile under DLO ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream_dtype", ["", "float8_e4m3fn"])
def test_streamed_blocks_run_compiled_and_give_the_eager_image(flux, tmp_path, stream_dtype):
    """DLO's pre-hooks point each block's parameters at its device slot, outside the compiled
    forward; the compiled block reads whatever the slot holds (8-bit streaming rebuilds it)."""
    from stagemesh.stage_service.models.runners import build_runner
    from stagemesh.stage_service.settings import DloOptions

    encoder, resident = flux
    folder = resident.folder.path
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dlo = {"enable_dlo": True, "dlo_use_allgather": False, "dlo_stream_dtype": stream_dtype}
        eager = build_runner("diffusion", folder, dlo=DloOptions(**dlo))
        streamed = build_runner("diffusion", folder, dlo=DloOptions(**dlo))
        settings = StageSettings(kind="diffusion", compile="regional", dlo_runtime_cache_dir=str(tmp_path), **dlo)
        accel = acceleration.prepare(streamed, settings, "cpu")
        assert accel.compiled and streamed.offload is not None
        item = _item(encoder, step_cache="off")
        [want] = eager.run([item])
        [got] = accel.run(streamed.run, [item])
        torch.testing.assert_close(got["image"], want["image"], rtol=0, atol=2e-3)
        assert streamed.offload.h2d_bytes > 0  # the blocks did stream
    finally:
        torch.set_num_threads(threads)

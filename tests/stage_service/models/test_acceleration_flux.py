"""Diffusers' step-cache hooks switched per batch and counted, and regional compile under DLO, on
a tiny FLUX folder (CPU, random weights): the half of the denoising-speed options that needs
diffusers' own transformer (tests/stage_service/models/test_acceleration.py has the rest).
"""

from __future__ import annotations

import re

import pytest
import torch

from stagemesh.core.params import STEP_CACHE_OUTPUT, STEP_CACHES, Params
from stagemesh.stage_service.models import acceleration
from stagemesh.stage_service.models.acceleration import compile as regional
from stagemesh.stage_service.settings import StageSettings
from tests.support.compile_child import tiny_dit

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

"""The video runners over a tiny Wan 2.2 folder, in this process (the mesh path and the frames'
equality with diffusers are tests/e2e/test_video.py's): progress through the pipeline's step
callback stops the call when it raises, what each stage reports as its limits, and the folder
and option errors a user can act on."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from stagemesh.core.params import Params
from stagemesh.stage_service.models.contract import WorkItem

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from stagemesh.stage_service.models.diffusers_adapter import FolderError, build_runner  # noqa: E402
from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny  # noqa: E402

PARAMS = Params("a red fox", 32, 32, 3, 3.0, 1, "tensor", negative_prompt="blurry", num_frames=5, fps=16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("wan") / "t2v", "wan")


@pytest.fixture(scope="module")
def embeddings(folder) -> dict:
    return build_runner("encoder", folder).run([WorkItem("r", PARAMS)])[0]


class Stop(Exception):
    pass


def test_a_raising_progress_stops_the_pipeline_between_steps(folder, embeddings):
    runner = build_runner("diffusion", folder)
    seen = []

    def progress(step: int, total: int) -> None:
        seen.append((step, total))
        raise Stop()

    with pytest.raises(Stop):
        runner.run([WorkItem("r", PARAMS, embeddings)], progress)
    assert seen == [(1, 3)]
    done = []
    (out,) = runner.run([WorkItem("r", PARAMS, embeddings)], lambda s, t: done.append((s, t)))
    assert done == [(1, 3), (2, 3), (3, 3)] and tuple(out["video"].shape) == (5, 32, 32, 3)


def test_every_stage_reports_the_frame_rule(folder):
    for kind in ("encoder", "diffusion"):
        limits = build_runner(kind, folder).limits()
        assert (limits["frame_step"], limits["default_num_frames"], limits["default_fps"]) == (4, 81, 16), kind
        assert limits["pixel_multiple"] == 16 and not limits["requires_init_image"]


def test_image_to_video_requires_its_start_image_at_the_diffusion_stage_only(tmp_path):
    folder = write_tiny(tmp_path / "i2v", "wan-i2v")
    assert build_runner("diffusion", folder).limits()["requires_init_image"]
    assert build_runner("diffusion", folder).supports_init_image
    assert not build_runner("encoder", folder).limits()["requires_init_image"]


def test_a_missing_expert_is_named(folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / "transformer_2")
    with pytest.raises(FolderError, match="transformer_2"):
        build_runner("diffusion", broken)


def test_sequence_parallel_is_refused_for_video(folder):
    class TwoRanks:  # what build_runner reads of a rank's parallel coordinate
        world = 2

    with pytest.raises(ValueError, match="not available for video models"):
        build_runner("diffusion", folder, parallel=TwoRanks())


def _bf16_folder(tmp_path: Path, stored: str) -> Path:
    """The tiny Wan folder in bfloat16: every tensor narrowed ("narrow"), or the transformers
    as diffusers saves them from a bfloat16 load, their float32 modules in float32 ("saved")."""
    from safetensors.torch import load_file, save_file

    diffusers = pytest.importorskip("diffusers")
    folder = write_tiny(tmp_path / "t2v", "wan")
    for name in ("transformer", "transformer_2"):
        if stored == "saved":
            model = diffusers.WanTransformer3DModel.from_pretrained(folder / name, torch_dtype=torch.bfloat16)
            model.save_pretrained(folder / name)
            continue
        for file in (folder / name).glob("*.safetensors"):
            tensors = load_file(file)
            save_file({k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in tensors.items()}, file)
    return folder


@pytest.mark.parametrize("stored", ["narrow", "saved"])
def test_dlo_frames_equal_resident_frames_of_a_bf16_folder(tmp_path, stored):
    """Wan keeps time_embedder, scale_shift_table and norm1-3 in float32 under a bfloat16 load;
    DLO must build its transformers so too (and map a checkpoint that stores them so)."""
    from stagemesh.stage_service.settings import DloOptions

    folder = _bf16_folder(tmp_path, stored)
    params = dataclasses.replace(PARAMS, num_inference_steps=2)
    embeddings = build_runner("encoder", folder).run([WorkItem("r", params)])[0]
    resident = build_runner("diffusion", folder)
    dlo = build_runner("diffusion", folder, dlo=DloOptions(enable_dlo=True, dlo_use_allgather=False))
    for name, model in dlo.experts.items():
        wanted = {
            k: t.dtype for k, t in [*resident.experts[name].named_parameters(), *resident.experts[name].named_buffers()]
        }
        got = {k: t.dtype for k, t in [*model.named_parameters(), *model.named_buffers()]}
        assert got == wanted and torch.float32 in got.values() and torch.bfloat16 in got.values(), name
    if stored == "saved":  # the checkpoint holds each tensor in the model's dtype: mapped, not copied
        assert all(engine.host_mode != "packed" for engine in dlo.engines.values())
    (want,) = resident.run([WorkItem("r", params, embeddings)])
    (got,) = dlo.run([WorkItem("r", params, embeddings)])
    assert torch.equal(got["video"], want["video"])

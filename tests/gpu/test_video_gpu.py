"""A tiny Wan 2.2 folder (both experts) served on the GPU, resident and with the transformers'
blocks streamed (DLO), against diffusers' WanPipeline on the same GPU: the float32 frames are the
same bytes (same kernels on both sides; the noise from a CPU generator, as the stage draws it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stagemesh.client import Client
from tests.support.meshproc import start_mesh

pytestmark = [pytest.mark.gpu, pytest.mark.mesh]
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("av")

from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny  # noqa: E402

CASE = {"width": 64, "height": 48, "num_frames": 9, "steps": 3, "guidance_scale": 4.0, "seed": 5}
PROMPT = "a lighthouse in a storm"


def _config(path: Path, dlo: bool) -> Path:
    dlo_keys = "enable_dlo = true\ndlo_use_allgather = false\n" if dlo else ""
    path.write_text(
        f'[gateway]\nport = 0\n\n[cache]\nroot = "{path.parent / "cache"}"\n\n'
        '[[stages]]\nkind = "encoder"\ndevice = "cuda"\n\n'
        f'[[stages]]\nkind = "diffusion"\ndevice = "cuda"\n{dlo_keys}'
    )
    return path


@pytest.mark.parametrize("dlo", [False, True], ids=["resident", "dlo"])
def test_wan_frames_on_the_gpu_equal_wan_pipeline(tmp_path, dlo):
    folder = write_tiny(tmp_path / "wan", "wan")
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, local_files_only=True).to("cuda")
    want = pipe(
        prompt=PROMPT,
        width=CASE["width"],
        height=CASE["height"],
        num_frames=CASE["num_frames"],
        num_inference_steps=CASE["steps"],
        guidance_scale=CASE["guidance_scale"],
        generator=torch.Generator().manual_seed(CASE["seed"]),
        output_type="np",
    ).frames[0]
    del pipe
    torch.cuda.empty_cache()
    mesh = start_mesh(_config(tmp_path / "mesh.toml", dlo), tmp_path / "mesh.log", ("--model", str(folder)))
    try:
        with Client(mesh.address) as client:
            got = client.generate_video(PROMPT, output_format="tensor", **CASE).frames
    finally:
        mesh.stop()
    assert got.tobytes() == np.ascontiguousarray(want, dtype=np.float32).tobytes()

"""`stagemesh synthesize`: the command writes a folder diffusers loads; the full-size path builds
every family at its published dimensions on meta (nothing allocated) and writes random tensors
one shard at a time that load back without a missing or unexpected key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.meshproc import REPO

pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

# family -> published transformer parameters, in billions (Z-Image-Turbo, Qwen-Image,
# FLUX.2 [klein] 4B, FLUX.1-dev, SD3 medium)
PUBLISHED = {"zimage": 6.15, "qwen-image": 20.43, "flux2-klein": 3.88, "flux": 11.90, "sd3": 2.03}


def _synthesize(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagemesh", "synthesize", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_command_offers_every_family_synthetic_builds():
    from stagemesh.cli import SYNTHETIC_FAMILIES
    from stagemesh.stage_service.models.diffusers_adapter.families import BY_NAME
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import TINY_FAMILIES

    assert list(SYNTHETIC_FAMILIES) == list(TINY_FAMILIES) and set(TINY_FAMILIES) == set(BY_NAME)
    assert all(BY_NAME[name].pipeline_class == cls for name, (cls, _) in TINY_FAMILIES.items())


def test_the_command_writes_a_tiny_folder_diffusers_loads(tmp_path):
    out = tmp_path / "klein"
    done = _synthesize("--family", "flux2-klein", "--size", "tiny", str(out))
    assert done.returncode == 0, done.stderr
    assert f"{out}: Flux2KleinPipeline (tiny, random weights)" in done.stdout
    pipe = diffusers.DiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert type(pipe).__name__ == "Flux2KleinPipeline"
    again = _synthesize("--family", "flux2-klein", str(out))
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
    unknown = _synthesize("--family", "hunyuan-video", str(tmp_path / "hv"))
    assert (
        unknown.returncode == 2 and "invalid choice: 'hunyuan-video'" in unknown.stderr and "zimage" in unknown.stderr
    )
    no_full = _synthesize("--family", "wan", "--size", "full", str(tmp_path / "wan"))
    assert no_full.returncode == 2 and "--size full of --family wan is not available" in no_full.stderr
    assert not (tmp_path / "wan").exists()


@pytest.mark.parametrize("family", list(PUBLISHED))
def test_full_size_builds_on_meta_at_the_published_dimensions(tmp_path, family):
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.full import _empty, full_components

    folder = write_tiny(tmp_path / family, family)
    transformer = _empty(full_components(family, folder, text_layers=2)["transformer"])
    assert all(p.is_meta for p in transformer.parameters())
    billions = sum(p.numel() for p in transformer.parameters()) / 1e9
    assert billions == pytest.approx(PUBLISHED[family], abs=0.01)


def test_random_shards_load_back_whole(tmp_path):
    """Qwen3-4B's width cut to 2 layers (its embedding and head tied) and a tiny FLUX.2
    transformer, written in bfloat16, the latter in small shards: every key comes back, the tie
    too."""
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux2 import TINY_TRANSFORMER
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.full import _empty, _qwen3, _replace
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.qwen_text import qwen_tokenizer

    tok = qwen_tokenizer()
    lm = _empty(lambda: _qwen3(tok, 2, causal_lm=True))
    _replace(tmp_path, "text_encoder", lm, torch.bfloat16, seed=1, device="cpu")
    transformer = _empty(lambda: diffusers.Flux2Transformer2DModel(**TINY_TRANSFORMER))
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import full

    full.SHARD_BYTES, saved = 4096, full.SHARD_BYTES
    try:
        _replace(tmp_path, "transformer", transformer, torch.bfloat16, seed=2, device="cpu")
    finally:
        full.SHARD_BYTES = saved
    index = json.loads((tmp_path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1

    import transformers

    loaded, info = transformers.Qwen3ForCausalLM.from_pretrained(
        tmp_path / "text_encoder", local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)
    model, info = diffusers.Flux2Transformer2DModel.from_pretrained(
        Path(tmp_path / "transformer"), local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    weights = [p for name, p in model.named_parameters() if name.endswith("weight") and p.dim() == 2]
    assert all(p.float().std() > 0.01 for p in weights)  # random, not zeros

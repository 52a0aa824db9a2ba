"""Diffusers stages split across real gloo ranks (CPU): FLUX by sequence (sp_size 2, Ulysses over
its 2 heads; 81 image tokens padded to 82), SD3 by guidance pass (cfg_parallel), resident and
under DLO; ring attention with FLUX's shared text tokens is checked in test_sequence_parallel.py.
The tiny checkpoints are those of test_diffusers_models.py (synthetic.write_tiny). The denoised
latents and the image of the output rank equal one rank's within float32 rounding; every rank
ends with the same latents.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.parallel import Axis, ImageParallel, form_axes
from stagemesh.stage_service.models.runners import WorkItem, build_runner
from stagemesh.stage_service.settings import DloOptions
from tests.support.gloo_ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

TOLERANCE = 1e-5  # float32 on the CPU: different attention shapes and pass sizes round differently
DLO = {"enable_dlo": True, "dlo_use_allgather": False}
# (width, height, steps, guidance, seed, prompt); 32x32 is 8x8 = 64 packed FLUX tokens, guidance
# 1.0 turns SD3's unconditional pass off.
GUIDED = (32, 32, 2, 3.5, 1, "a red fox")
ODD = (36, 36, 2, 3.5, 2, "rain on a tin roof")  # 18x18 latent: 81 FLUX tokens
UNGUIDED = (32, 32, 2, 1.0, 3, "a boat")
# name -> (family, kind, sp_size, cfg passes, DLO options, cases), all on one group of 2 ranks
PLANS: dict[str, tuple] = {
    "flux-sp2": ("flux", "denoise", 2, 1, {}, [GUIDED, ODD]),
    "flux-sp2-image": ("flux", "diffusion", 2, 1, {}, [GUIDED]),
    "flux-sp2-dlo": ("flux", "denoise", 2, 1, DLO, [ODD]),
    "sd3-cfg": ("sd3", "denoise", 1, 2, {}, [GUIDED, UNGUIDED]),
    "sd3-cfg-image": ("sd3", "diffusion", 1, 2, DLO, [GUIDED]),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny

    root = tmp_path_factory.mktemp("diffusers-parallel")
    return {family: write_tiny(root / family, family) for family in ("flux", "sd3")}


def _params(case) -> Params:
    width, height, steps, guidance, seed, prompt = case
    return Params(prompt, width, height, steps, guidance, seed, "tensor")


@pytest.fixture(scope="module")
def inputs(folders) -> dict[tuple, dict[str, torch.Tensor]]:
    """The encoder stage's embeddings of every case, per family."""
    torch.set_num_threads(1)
    out = {}
    for family, folder in folders.items():
        encoder = build_runner("encoder", folder)
        for fam, *_, cases in PLANS.values():
            for case in cases if fam == family else ():
                [out[family, case]] = encoder.run([WorkItem("r", _params(case))])
    return out


def _outputs(runner, kind: str, case, embeds) -> torch.Tensor | None:
    answered = runner.run([WorkItem("r", _params(case), dict(embeds))])
    if not answered:
        return None
    return answered[0]["latents" if kind == "denoise" else "image"]


def _rank_plans(rank: int, world: int, folders: dict, inputs: dict) -> dict[str, list]:
    out: dict[str, list] = {}
    for name, (family, kind, sp, cfg, dlo, cases) in PLANS.items():
        parallel = form_axes(sp, cfg, rank)
        runner = build_runner(kind, folders[family], dlo=DloOptions(**dlo), parallel=parallel)
        results = []
        for case in cases:
            if kind == "denoise" and not parallel.output:
                # Non-output ranks answer nothing: read their latents through the sampler itself.
                results.append(_latents_of(runner, case, inputs[family, case]))
            else:
                results.append(_outputs(runner, kind, case, inputs[family, case]))
        out[name] = results
    return out


def _latents_of(runner, case, embeds) -> torch.Tensor | None:
    from stagemesh.stage_service.models.diffusers_adapter import sampling
    from stagemesh.stage_service.models.diffusers_adapter.parallel import runs_unconditional

    params = _params(case)
    if runner.parallel.cfg.rank > 0 and not runs_unconditional(params.guidance_scale):
        return None
    generators = [torch.Generator("cpu").manual_seed(params.seed)]
    batch = {k: v[None] for k, v in embeds.items()}
    with torch.inference_mode():
        return sampling.sample(runner.pipe, runner.sampling_family, batch, params, generators)[0]


@pytest.fixture(scope="module")
def single(folders, inputs) -> dict[tuple, torch.Tensor]:
    torch.set_num_threads(1)
    runners: dict[tuple, object] = {}
    out = {}
    for family, kind, *_, cases in PLANS.values():
        runner = runners.setdefault((family, kind), build_runner(kind, folders[family]))
        for case in cases:
            out[family, kind, case] = _outputs(runner, kind, case, inputs[family, case])
    return out


def test_split_pipelines_equal_one_rank(folders, inputs, single):
    args = {family: str(path) for family, path in folders.items()}
    results = run_ranks(2, _rank_plans, args, inputs)
    worst = 0.0
    for name, (family, kind, _, cfg, _, cases) in PLANS.items():
        for i, case in enumerate(cases):
            want = single[family, kind, case]
            got = results[0][name][i]
            diff = (got - want).abs().max().item()
            worst = max(worst, diff)
            assert diff <= TOLERANCE, (name, case, diff)
            other = results[1][name][i]
            if kind == "diffusion":
                assert other is None  # the image is decoded on the output rank alone
            elif cfg > 1 and case[3] == 1.0:
                assert other is None, "an unguided batch leaves the unconditional rank idle"
            else:
                assert torch.equal(other, got), name
    print(f"2 ranks: largest difference from one rank {worst:.2e}")


def test_pipelines_without_the_split_are_refused_at_load(folders):
    """FLUX has no unconditional pass to move to a second rank; SD3's tokens are not split."""
    cfg = ImageParallel(cfg=Axis(2, 0, object()))
    with pytest.raises(ValueError, match="cfg_parallel = true with FluxPipeline: its guidance scale is distilled"):
        build_runner("diffusion", folders["flux"], parallel=cfg)
    sp = ImageParallel(sp=Axis(2, 0, object()))
    with pytest.raises(ValueError, match="sp_size = 2 with StableDiffusion3Pipeline: .*set sp_size = 1"):
        build_runner("denoise", folders["sd3"], parallel=sp)
    with pytest.raises(ValueError, match="split a denoising stage, not kind 'encoder'"):
        build_runner("encoder", folders["flux"], parallel=sp)

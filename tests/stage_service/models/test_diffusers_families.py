"""The families beyond FLUX.1 and SD3 through real meshes (`stagemesh up --model`): tiny
random-weight Z-Image, Qwen-Image and FLUX.2 [klein] folders (synthetic.write_tiny: configs
shrunk, Qwen2 tokenizers built offline) give the PNG bytes of diffusers' own pipeline loaded from
the same folder with the same seed and arguments. Qwen-Image runs split (encoder -> denoise under
DLO -> decode): its VAE tail runs in its own stage.

The three meshes start once for the module, in parallel.
"""

from __future__ import annotations

import functools
from pathlib import Path

import grpc
import pytest
import torch

from stagemesh.gateway.images import encode_png
from stagemesh.stage_service.transport import tensors
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import Mesh, parallel_meshes, start_mesh
from tests.support.sleep_mesh import field_violations

pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

RPC_TIMEOUT_S = 120.0
STAGE = """
[[stages]]
kind = "{kind}"
threads = 1
{extra}
"""
DLO = "enable_dlo = true\ndlo_use_allgather = false"
# name -> [(kind, extra keys)]; model_dir comes from --model, the folder of the same name.
MESHES = {
    "zimage": [("encoder", ""), ("diffusion", "")],
    "qwen-image": [("encoder", ""), ("denoise", DLO), ("decode", "")],
    "flux2-klein": [("encoder", ""), ("diffusion", "")],
}
# family -> [(width, height, steps, guidance, seed, prompt, negative prompt)]
CASES = {
    # Z-Image guides above guidance 0: its unconditional input is the negative prompt or "".
    "zimage": [(32, 32, 2, 4.0, 1, "a red fox", "blurry"), (48, 32, 2, 2.5, 2, "rain on a tin roof", "")],
    # Qwen-Image: true CFG (true_cfg_scale) runs only with a negative prompt.
    "qwen-image": [(32, 32, 2, 4.0, 1, "a red fox", "blurry"), (32, 48, 2, 4.0, 2, "rain on a tin roof", "")],
    # FLUX.2 [klein] (not distilled): CFG against the empty prompt above guidance 1.
    "flux2-klein": [(32, 32, 2, 4.0, 1, "a red fox", ""), (32, 32, 2, 1.0, 2, "a boat", "")],
}


def _config(path: Path, stages) -> Path:
    tables = "".join(STAGE.format(kind=k, extra=e) for k, e in stages)
    path.write_text(f'[gateway]\nport = 0\n\n[cache]\nroot = "{path.parent / "cache"}"\n{tables}')
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny

    root = tmp_path_factory.mktemp("families")
    return {family: write_tiny(root / family, family) for family in MESHES}


@pytest.fixture(scope="module")
def meshes(folders, tmp_path_factory) -> dict[str, Mesh]:
    def start(name: str) -> Mesh:
        root = tmp_path_factory.mktemp(name)
        return start_mesh(_config(root / "mesh.toml", MESHES[name]), root / "mesh.log", ("--model", str(folders[name])))

    # diffusers' own images are computed while the meshes load.
    starters = {name: functools.partial(start, name) for name in MESHES}
    with parallel_meshes(starters, while_starting=lambda: _reference(tuple(folders.items()))) as started:
        yield started


def _diffusers_call(pipe, family: str, case, **extra):
    width, height, steps, guidance, seed, prompt, negative = case
    guided = {"true_cfg_scale": guidance} if family == "qwen-image" else {"guidance_scale": guidance}
    if negative:
        extra["negative_prompt"] = negative
    return pipe(
        prompt=prompt,
        width=width,
        height=height,
        num_inference_steps=steps,
        output_type="pt",
        generator=torch.Generator().manual_seed(seed),
        **guided,
        **extra,
    ).images


@pytest.fixture(scope="module")
def reference(folders) -> dict[tuple, torch.Tensor]:
    return _reference(tuple(folders.items()))


@functools.cache
def _reference(folders: tuple[tuple[str, Path], ...]) -> dict[tuple, torch.Tensor]:
    """diffusers' own pipeline, loaded as any user would, one thread as the stages run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for family, folder in folders:
            pipe = diffusers.DiffusionPipeline.from_pretrained(folder, local_files_only=True)
            for case in CASES[family]:
                out[family, case] = _diffusers_call(pipe, family, case)[0].permute(1, 2, 0).float()
    finally:
        torch.set_num_threads(threads)
    return out


def _params(case, output_format=generation_pb2.OUTPUT_FORMAT_PNG, **extra) -> generation_pb2.GenerationParams:
    width, height, steps, guidance, seed, prompt, negative = case
    return generation_pb2.GenerationParams(
        prompt=prompt,
        negative_prompt=negative,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        output_format=output_format,
        **extra,
    )


def _generate(m: Mesh, params: generation_pb2.GenerationParams):
    with m.channel() as channel:
        reply = m.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=RPC_TIMEOUT_S)
    return reply.result


@pytest.mark.parametrize("family", list(MESHES))
@pytest.mark.mesh
def test_image_equals_diffusers_own_pipeline(meshes, reference, family):
    for case in CASES[family]:
        want = reference[family, case]
        assert _generate(meshes[family], _params(case)).png == encode_png(want.numpy()), (family, case)
        raw = _generate(meshes[family], _params(case, generation_pb2.OUTPUT_FORMAT_TENSOR))
        got = tensors.from_proto(raw.tensor)
        if family in ("qwen-image", "flux2-klein"):
            # The stage runs from aligned copies of the weights (DLO's slots, the direct load);
            # diffusers' CPU weights are views into the safetensors mapping, where MKL's GEMV can
            # round differently (last bits; seen on some CPUs). The PNG above is exact.
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        else:
            assert torch.equal(got, want), (family, case, (got - want).abs().max())


@pytest.mark.mesh
def test_qwen_image_negative_prompt_steers_true_cfg(meshes):
    with_negative, without = CASES["qwen-image"][0], CASES["qwen-image"][0][:-1] + ("",)
    assert _generate(meshes["qwen-image"], _params(with_negative)).png != (
        _generate(meshes["qwen-image"], _params(without)).png
    )


@pytest.mark.mesh
def test_a_negative_prompt_on_flux2_klein_is_invalid_argument_naming_it(meshes):
    case = CASES["flux2-klein"][0][:-1] + ("blurry",)
    with pytest.raises(grpc.RpcError) as refused:
        _generate(meshes["flux2-klein"], _params(case))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert list(field_violations(refused.value)) == ["params.negative_prompt"]


@pytest.mark.mesh
def test_a_starting_image_where_the_family_takes_none_is_invalid_argument(meshes):
    start = encode_png(torch.rand(32, 32, 3).numpy())
    with pytest.raises(grpc.RpcError) as refused:
        # FLUX.2 [klein] declares no image-to-image class.
        _generate(meshes["flux2-klein"], _params(CASES["flux2-klein"][0], init_image=start, strength=0.5))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "params.init_image" in field_violations(refused.value)


def test_zimage_batch_of_prompts_of_two_lengths_equals_diffusers_batched_call(folders):
    """Z-Image keeps each prompt at its own length: the stage hands the pipeline a list, one
    generator per item, as diffusers' own batched call takes them."""
    from stagemesh.core.params import Params
    from stagemesh.stage_service.models.contract import WorkItem
    from stagemesh.stage_service.models.diffusers_adapter import build_runner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        encoder, diffusion = build_runner("encoder", folders["zimage"]), build_runner("diffusion", folders["zimage"])
        prompts, seeds = ["a red fox", "rain on a tin roof at night"], [3, 9]
        batch = [
            WorkItem(f"r{i}", Params(p, 32, 32, 2, 4.0, s, "tensor")) for i, (p, s) in enumerate(zip(prompts, seeds))
        ]
        for work in batch:
            [work.inputs] = encoder.run([work])
        assert batch[0].inputs["prompt_embeds"].shape != batch[1].inputs["prompt_embeds"].shape
        got = diffusion.run(batch)
        pipe = diffusers.DiffusionPipeline.from_pretrained(folders["zimage"], local_files_only=True)
        want = pipe(
            prompt=prompts,
            width=32,
            height=32,
            num_inference_steps=2,
            guidance_scale=4.0,
            output_type="pt",
            generator=[torch.Generator().manual_seed(s) for s in seeds],
        ).images
        for out, expected in zip(got, want):
            expected = expected.permute(1, 2, 0).float()
            # The runner's weights are aligned copies (the direct load), diffusers' are views into
            # the safetensors mapping: MKL may round the last bits differently; the PNG is exact.
            assert encode_png(out["image"].numpy()) == encode_png(expected.numpy())
            torch.testing.assert_close(out["image"], expected, rtol=0, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("family", "pipeline_class"), [("zimage", "ZImageImg2ImgPipeline"), ("qwen-image", "QwenImageImg2ImgPipeline")]
)
def test_img2img_equals_the_familys_img2img_pipeline(folders, family, pipeline_class):
    """The starting image through the family's declared Img2Img class, fused and split (the
    denoise stage's latents decoded by the decode stage), with a negative prompt."""
    from PIL import Image

    from stagemesh.core.params import Params
    from stagemesh.stage_service.models.contract import INIT_IMAGE_INPUT, WorkItem
    from stagemesh.stage_service.models.diffusers_adapter import build_runner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder = folders[family]
        image = torch.randint(0, 256, (32, 48, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        work = WorkItem("r", Params("a red fox", 48, 32, 5, 4.0, 3, "tensor", negative_prompt="blurry", strength=0.6))
        [work.inputs] = build_runner("encoder", folder).run([work])
        work.inputs[INIT_IMAGE_INPUT] = image
        steps: list[tuple[int, int]] = []
        [fused] = build_runner("diffusion", folder).run(
            [work], progress=lambda step, total: steps.append((step, total))
        )
        [latents] = build_runner("denoise", folder).run([work])
        [split] = build_runner("decode", folder).run([WorkItem("r", work.params, latents)])
        pipe = getattr(diffusers, pipeline_class).from_pretrained(folder, local_files_only=True)
        case = (48, 32, 5, 4.0, 3, "a red fox", "blurry")
        want = _diffusers_call(pipe, family, case, image=Image.fromarray(image.numpy()), strength=0.6)[0]
        want = want.permute(1, 2, 0).float()
        assert steps == [(1, 3), (2, 3), (3, 3)]  # 5 steps at strength 0.6: the last 3
        assert torch.equal(fused["image"], want)
        assert torch.equal(split["image"], want)
    finally:
        torch.set_num_threads(threads)


def test_the_declarations_are_the_classes_checked_at_start():
    from stagemesh.stage_service.models.diffusers_adapter.families import FAMILIES
    from stagemesh.stage_service.models.diffusers_adapter.folder import PIPELINE_CLASSES

    assert sorted(FAMILIES) == list(PIPELINE_CLASSES)


def test_an_unknown_pipeline_class_is_refused_at_start_naming_the_supported(folders, tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tests.support.meshproc import REPO

    other = tmp_path / "other"
    other.mkdir()
    for entry in folders["zimage"].iterdir():
        if entry.is_dir():
            os.symlink(entry, other / entry.name)
    index = json.loads((folders["zimage"] / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "HunyuanVideoPipeline"}))
    config = _config(tmp_path / "mesh.toml", MESHES["zimage"])
    done = subprocess.run(
        [sys.executable, "-m", "stagemesh", "up", "--config", str(config), "--model", str(other)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pipeline class 'HunyuanVideoPipeline' is not supported" in done.stderr
    assert "'QwenImagePipeline'" in done.stderr and "'ZImagePipeline'" in done.stderr

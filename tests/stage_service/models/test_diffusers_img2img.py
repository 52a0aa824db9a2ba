"""Image-to-image and the negative prompt on diffusers-format checkpoints, at the runner level:
the encoder and denoising runners a stage's workers load, over tiny FLUX-style and SD3-style
folders (random weights, built offline). The oracle is diffusers' own pipeline — FluxImg2ImgPipeline,
StableDiffusion3Img2ImgPipeline, StableDiffusion3Pipeline(negative_prompt=...) — loaded from the
same folder, fed the same starting image (as a PIL image), seed, prompt and strength.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from stagemesh.core.params import Params
from stagemesh.gateway.images import encode_png
from stagemesh.stage_service.models.contract import INIT_IMAGE_INPUT, ItemError, WorkItem
from stagemesh.stage_service.models.diffusers_adapter import build_runner
from stagemesh.stage_service.models.diffusers_adapter.sampling import DEFAULT_STRENGTH, skipped_steps
from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny
from tests.support.pictures import assert_same_picture

pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

FAMILIES = ("flux", "sd3")
IMG2IMG_PIPELINES = {"flux": "FluxImg2ImgPipeline", "sd3": "StableDiffusion3Img2ImgPipeline"}
WIDTH, HEIGHT, STEPS = 48, 32, 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread, as a stage's worker runs; the oracle runs in the same process alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("diffusers-img2img")
    return {family: write_tiny(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def runners(folders) -> dict[tuple[str, str], object]:
    kinds = ("encoder", "diffusion")
    return {(family, kind): build_runner(kind, folders[family]) for family in FAMILIES for kind in kinds}


def picture(seed: int) -> torch.Tensor:
    """A starting image as the gateway hands it on: uint8 [height, width, 3] RGB."""
    return torch.randint(0, 256, (HEIGHT, WIDTH, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def item(encoder, image: torch.Tensor | None = None, request_id: str = "r", **params) -> WorkItem:
    """A request as it reaches the denoising stage: the encoder stage's outputs (+ the image)."""
    fields = {"prompt": "a red fox", "guidance_scale": 3.5, "seed": 1, **params}
    work = WorkItem(
        request_id,
        Params(
            fields.pop("prompt"),
            WIDTH,
            HEIGHT,
            STEPS,
            fields.pop("guidance_scale"),
            fields.pop("seed"),
            "tensor",
            **fields,
        ),
    )
    [work.inputs] = encoder.run([work])
    if image is not None:
        work.inputs[INIT_IMAGE_INPUT] = image
    return work


def oracle(folders, family: str, pipeline_class: str, work: WorkItem, image: torch.Tensor | None = None, **extra):
    """diffusers' own pipeline for the same request, as a user would call it."""
    pipe = getattr(diffusers, pipeline_class).from_pretrained(folders[family], local_files_only=True)
    p = work.params
    if image is not None:
        extra.update(image=Image.fromarray(image.numpy()), strength=p.strength)
    if p.negative_prompt:
        extra["negative_prompt"] = p.negative_prompt
    out = pipe(
        prompt=p.prompt,
        width=p.width,
        height=p.height,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        output_type="pt",
        generator=torch.Generator().manual_seed(p.seed),
        **extra,
    ).images[0]
    return out.permute(1, 2, 0).float()


@pytest.mark.parametrize("strength", [0.6, 0.3])
@pytest.mark.parametrize("family", FAMILIES)
def test_img2img_equals_diffusers_img2img_pipeline(folders, runners, family, strength):
    image = picture(7)
    work = item(runners[family, "encoder"], image, strength=strength, seed=3)
    [out] = runners[family, "diffusion"].run([work])
    want = oracle(folders, family, IMG2IMG_PIPELINES[family], work, image)
    assert_same_picture(out["image"], want)


@pytest.mark.parametrize("family", FAMILIES)
def test_img2img_runs_the_strengths_last_steps_from_the_image(runners, family):
    steps = []
    work = item(runners[family, "encoder"], picture(7), strength=0.6)
    [near] = runners[family, "diffusion"].run([work], progress=lambda step, total: steps.append((step, total)))
    # 5 steps at strength 0.6: the last 3 of the schedule, reported as 3 steps.
    assert steps == [(1, 3), (2, 3), (3, 3)]
    [other_start] = runners[family, "diffusion"].run([item(runners[family, "encoder"], picture(8), strength=0.6)])
    [from_noise] = runners[family, "diffusion"].run([item(runners[family, "encoder"])])
    # The starting image shows through: another image, or none, gives another result.
    assert not torch.equal(near["image"], other_start["image"])
    assert not torch.equal(near["image"], from_noise["image"])


@pytest.mark.parametrize("family", FAMILIES)
def test_strength_unset_with_an_image_is_the_default(runners, family):
    image = picture(7)
    [unset] = runners[family, "diffusion"].run([item(runners[family, "encoder"], image)])
    [default] = runners[family, "diffusion"].run([item(runners[family, "encoder"], image, strength=DEFAULT_STRENGTH)])
    assert torch.equal(unset["image"], default["image"])


@pytest.mark.parametrize("family", FAMILIES)
def test_split_stages_give_the_same_img2img_image(folders, runners, family):
    """encoder -> denoise -> decode: the denoise stage encodes the image with its own VAE."""
    work = item(runners[family, "encoder"], picture(7), strength=0.6)
    [fused] = runners[family, "diffusion"].run([work])
    [latents] = build_runner("denoise", folders[family]).run([work])
    decoded = WorkItem("r", work.params, latents)
    [split] = build_runner("decode", folders[family]).run([decoded])
    assert torch.equal(split["image"], fused["image"])


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_sd3_negative_prompt_equals_diffusers(folders, runners, guidance):
    work = item(runners["sd3", "encoder"], guidance_scale=guidance, negative_prompt="blurry, dark")
    [out] = runners["sd3", "diffusion"].run([work])
    want = oracle(folders, "sd3", "StableDiffusion3Pipeline", work)
    assert torch.equal(out["image"], want), (out["image"] - want).abs().max()
    assert encode_png(out["image"].numpy()) == encode_png(want.numpy())
    [plain] = runners["sd3", "diffusion"].run([item(runners["sd3", "encoder"], guidance_scale=guidance)])
    # It steers only the unconditional pass, which guidance 1 does not run.
    assert torch.equal(out["image"], plain["image"]) == (guidance == 1.0)


def test_sd3_negative_prompt_with_img2img_equals_diffusers(folders, runners):
    image = picture(5)
    work = item(runners["sd3", "encoder"], image, strength=0.6, negative_prompt="blurry")
    [out] = runners["sd3", "diffusion"].run([work])
    assert torch.equal(out["image"], oracle(folders, "sd3", "StableDiffusion3Img2ImgPipeline", work, image))


def test_what_each_runner_declares(runners, folders):
    assert runners["sd3", "encoder"].supports_negative_prompt
    assert runners["sd3", "diffusion"].supports_negative_prompt
    assert not runners["flux", "encoder"].supports_negative_prompt
    assert not runners["flux", "diffusion"].supports_negative_prompt
    for family in FAMILIES:
        # The starting image goes to the denoising stage (its VAE encodes it), no other.
        assert runners[family, "diffusion"].supports_init_image
        assert build_runner("denoise", folders[family]).supports_init_image
        assert not runners[family, "encoder"].supports_init_image
        assert not build_runner("decode", folders[family]).supports_init_image


def test_flux_encoder_refuses_a_negative_prompt(runners):
    encoder = runners["flux", "encoder"]
    fine = WorkItem("a", Params("a fox", WIDTH, HEIGHT, STEPS, 3.5, 1, "tensor"))
    refused = WorkItem("b", Params("a fox", WIDTH, HEIGHT, STEPS, 3.5, 1, "tensor", negative_prompt="blurry"))
    with pytest.raises(ItemError, match="b: params.negative_prompt is not supported by FluxPipeline") as caught:
        encoder.run([fine, refused])
    assert caught.value.index == 1


def test_batch_of_two_img2img_items(folders, runners):
    """Each item keeps its own image and seed: the batch's latents equal diffusers' own batched
    call bit for bit. Against each item run alone they agree to float rounding, not bitwise:
    the transformer's matrix products over two items' rows block differently on the CPU."""
    family = "sd3"
    encoder = runners[family, "encoder"]
    batch = [
        item(encoder, picture(7), "r0", strength=0.7, seed=3),
        item(encoder, picture(8), "r1", strength=0.7, seed=9, prompt="rain on a tin roof"),
    ]
    latents = build_runner("denoise", folders[family]).run(batch)
    pipe = diffusers.StableDiffusion3Img2ImgPipeline.from_pretrained(folders[family], local_files_only=True)
    embeds = {name: torch.stack([work.inputs[name] for work in batch]) for name in batch[0].inputs if "embeds" in name}
    want = pipe(
        image=[Image.fromarray(work.inputs[INIT_IMAGE_INPUT].numpy()) for work in batch],
        strength=0.7,
        width=WIDTH,
        height=HEIGHT,
        num_inference_steps=STEPS,
        guidance_scale=3.5,
        output_type="latent",
        generator=[torch.Generator().manual_seed(work.params.seed) for work in batch],
        **embeds,
    ).images
    for got, expected in zip(latents, want):
        assert torch.equal(got["latents"], expected)
    together = runners[family, "diffusion"].run(batch)
    for work, out in zip(batch, together):
        [alone] = runners[family, "diffusion"].run([work])
        torch.testing.assert_close(out["image"], alone["image"], rtol=0, atol=1e-5)
    assert not torch.equal(together[0]["image"], together[1]["image"])


def test_bad_img2img_items_are_refused_alone(runners):
    encoder, diffusion = runners["flux", "encoder"], runners["flux", "diffusion"]
    good = item(encoder, picture(7), "good", strength=0.5)
    no_image = item(encoder, None, "no-image", strength=0.5)
    with pytest.raises(ItemError, match="no-image: inputs lack 'init_image'") as caught:
        diffusion.run([good, no_image])
    assert caught.value.index == 1
    wrong_size = item(encoder, picture(7)[:16], "small", strength=0.5)
    with pytest.raises(ItemError, match=r"'init_image' must be uint8 \[32, 48, 3\]") as caught:
        diffusion.run([good, wrong_size])
    assert caught.value.index == 1
    floats = item(encoder, picture(7).float(), "floats", strength=0.5)
    with pytest.raises(ItemError, match="got torch.float32"):
        diffusion.run([floats])
    # Text-to-image items in an image-to-image batch (strength unset by the caller).
    with pytest.raises(ItemError, match="other items of its batch have one") as caught:
        diffusion.run([item(encoder, picture(7), "img"), item(encoder, None, "txt")])
    assert caught.value.index == 1
    with pytest.raises(ValueError, match="params.strength 1.5 is out of range"):
        diffusion.run([item(encoder, picture(7), strength=1.5)])


def test_skipped_steps_follow_the_pipelines_rule():
    assert [skipped_steps(5, s) for s in (1.0, 0.8, 0.6, 0.3, 0.01)] == [0, 1, 2, 3, 4]
    assert [skipped_steps(28, s) for s in (0.95, 0.5, 0.1)] == [1, 14, 25]

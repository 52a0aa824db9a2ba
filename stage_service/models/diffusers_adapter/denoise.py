"""Stage kinds "diffusion" (transformer + scheduler loop + VAE decode -> image), "denoise" (the
same without the decode -> latents) and "decode" (the VAE alone: latents -> image).

The denoising stages run `sampling.sample` over the encoder stage's embeddings with one CPU
generator per request seeded with its seed. Text-to-image equals `pipe(prompt=...,
generator=torch.Generator().manual_seed(seed))` of the unsplit pipeline; image-to-image (a
starting image in INIT_IMAGE_INPUT, params.strength) equals the family's Img2Img pipeline called
with `image=...` and `strength=...`. Both denoising kinds load the VAE: its encoder turns a
starting image into latents.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stagemesh.stage_service.models.contract import (
    INIT_IMAGE_INPUT,
    ItemError,
    RunnerBase,
    WeightFile,
    WorkItem,
    check_batch,
)
from stagemesh.stage_service.models.diffusers_adapter.direct import load_components
from stagemesh.stage_service.models.diffusers_adapter.families import family_of, pixel_multiple
from stagemesh.stage_service.models.diffusers_adapter.folder import check_stage_folder
from stagemesh.stage_service.models.diffusers_adapter.loading import (
    checkpoint_dtype,
    load_pipeline,
    load_transformer,
    refuse_unsupported,
    weight_files,
)
from stagemesh.stage_service.models.diffusers_adapter.parallel import for_sampling, runs_unconditional
from stagemesh.stage_service.models.diffusers_adapter.sampling import DEFAULT_STRENGTH, decode, sample
from stagemesh.stage_service.models.parallel import ImageParallel
from stagemesh.stage_service.settings import DloOptions

REQUIRED_INPUTS = ("prompt_embeds", "pooled_prompt_embeds")
# The encoder stage's text length per pipeline (FLUX: T5 at 512; SD3: CLIP's 77 + T5's 256).
WARM_UP_TEXT_TOKENS = {"FluxPipeline": 512, "StableDiffusion3Pipeline": 333}
OPTIONAL_INPUTS = ("negative_prompt_embeds", "negative_pooled_prompt_embeds")


def starting_images(batch) -> tuple[list[torch.Tensor] | None, float]:
    """The batch's starting images and strength; (None, 1.0) for text-to-image. Items share
    params.strength (the batch key); unset with starting images means DEFAULT_STRENGTH."""
    strength = batch[0].params.strength
    given = [INIT_IMAGE_INPUT in item.inputs for item in batch]
    if strength is None and not any(given):
        return None, 1.0
    if strength is not None and not 0 < strength <= 1:
        raise ValueError(f"params.strength {strength} is out of range; allowed: greater than 0, at most 1")
    images = []
    for index, item in enumerate(batch):
        image = item.inputs.get(INIT_IMAGE_INPUT)
        if image is None:
            why = "params.strength is set" if strength is not None else "other items of its batch have one"
            raise ItemError(index, f"{item.request_id}: inputs lack {INIT_IMAGE_INPUT!r} ({why})")
        want = [item.params.height, item.params.width, 3]
        if image.dtype != torch.uint8 or list(image.shape) != want:
            raise ItemError(
                index,
                f"{item.request_id}: {INIT_IMAGE_INPUT!r} must be uint8 {want} (height, width, RGB); "
                f"got {image.dtype} {list(image.shape)}",
            )
        images.append(image)
    return images, DEFAULT_STRENGTH if strength is None else strength


class DenoiseRunner(RunnerBase):
    """kind "diffusion" decodes with the VAE; kind "denoise" hands latents to a "decode" stage."""

    supports_init_image = True

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        dlo: DloOptions | None = None,
        kind: str = "diffusion",
        parallel: ImageParallel | None = None,
    ) -> None:
        opts = dlo or DloOptions()
        refuse_unsupported(opts)
        self.kind = kind
        self.decodes = kind == "diffusion"
        self.device = device
        self.folder = check_stage_folder(model_dir, kind)
        self.family = family_of(self.folder)
        # The negative embeddings reach this stage only where the family guides with them.
        self.supports_negative_prompt = self.family.supports_negative_prompt
        dtype = checkpoint_dtype(self.folder)
        # Resident, the transformer and the VAE are read straight to the device together.
        if opts.enable_dlo:
            self.transformer, self.offload = load_transformer(self.folder, self.family, device, dtype, opts)
            parts = load_components(self.folder, ["vae"], device, dtype)
        else:
            parts = load_components(self.folder, ["transformer", "vae"], device, dtype)
            self.transformer, self.offload = parts["transformer"], None
        self.pipe = load_pipeline(self.folder, ["scheduler"], dtype, transformer=self.transformer, vae=parts["vae"])
        # Sequence / CFG parallel: every rank samples; rank 0 alone decodes and answers.
        self.parallel = parallel or ImageParallel()
        self.sampling_family = for_sampling(self.family, self.transformer, self.parallel)

    def weight_files(self) -> list[WeightFile]:
        # Under DLO the streamed blocks belong to the offload engine; sleep manages the rest.
        streamed = self.offload.streamed if self.offload is not None else ()
        skip = tuple(f"{block.path}." for block in streamed)
        files = weight_files(self.folder, "transformer", self.transformer, skip)
        return files + weight_files(self.folder, "vae", self.pipe.vae)

    def device_holders(self) -> list:
        return [self.offload] if self.offload is not None else []

    def _embeddings(self, batch) -> dict[str, torch.Tensor]:
        names = [n for n in REQUIRED_INPUTS + OPTIONAL_INPUTS if n in batch[0].inputs]
        for item in batch:
            needed = REQUIRED_INPUTS + (self.family.guided_inputs if item.params.guidance_scale > 1 else ())
            missing = [n for n in needed if n not in item.inputs]
            if missing:
                raise ValueError(
                    f"{item.request_id}: inputs lack {missing} (got "
                    f"{sorted(item.inputs)}); the stage before must be an "
                    "'encoder' stage of the same checkpoint"
                )
        return {n: torch.stack([item.inputs[n] for item in batch]).to(self.device) for n in names}

    @torch.inference_mode()
    def run(self, batch, progress=None) -> list[dict[str, torch.Tensor]]:
        """The whole batch as one sampling loop; items share shape, steps, guidance and strength.
        `progress(step, steps run)` follows each step and may raise to abort."""
        if not batch:
            return []
        check_batch(batch)
        images, strength = starting_images(batch)
        params = batch[0].params
        if self.parallel.cfg.rank > 0 and not runs_unconditional(params.guidance_scale):
            return []  # no unconditional pass to run: rank 0 runs the batch alone
        generators = [torch.Generator("cpu").manual_seed(item.params.seed) for item in batch]
        embeds = self._embeddings(batch)
        latents = sample(self.pipe, self.sampling_family, embeds, params, generators, images, strength, progress)
        if not self.parallel.output:
            return []  # the output rank holds the same latents and answers
        if self.decodes:
            return [{"image": decode(self.pipe, self.family, lat, params)} for lat in latents]
        return [{"latents": lat.detach()} for lat in latents]

    def limits(self) -> dict:
        return {"pixel_multiple": pixel_multiple(self.folder)}

    def warm_up_items(self, params) -> list[WorkItem] | None:
        """Zero embeddings shaped as the encoder stage sends them (its text length, the
        transformer's widths), every one the family guides with; None for a family whose
        shapes are not known here."""
        config = self.transformer.config
        tokens = WARM_UP_TEXT_TOKENS.get(self.family.pipeline_class)
        width = getattr(config, "joint_attention_dim", None)
        pooled_width = getattr(config, "pooled_projection_dim", None)
        if tokens is None or width is None or pooled_width is None:
            return None
        text = torch.zeros(tokens, width, dtype=self.transformer.dtype)
        pooled = torch.zeros(pooled_width, dtype=self.transformer.dtype)
        inputs = {"prompt_embeds": text, "pooled_prompt_embeds": pooled}
        if self.family.guided_inputs and params.guidance_scale > 1:
            inputs |= {"negative_prompt_embeds": text, "negative_pooled_prompt_embeds": pooled}
        return [WorkItem("warm-up", params, inputs)]


class DecodeRunner(RunnerBase):
    """kind "decode": the VAE as its own stage, after a "denoise" stage."""

    kind = "decode"

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        self.folder = check_stage_folder(model_dir, self.kind)
        self.family = family_of(self.folder)
        self.device = device
        dtype = checkpoint_dtype(self.folder)
        self.vae = load_components(self.folder, ["vae"], device, dtype)["vae"]
        self.pipe = load_pipeline(self.folder, [], dtype, vae=self.vae)

    def weight_files(self) -> list[WeightFile]:
        return weight_files(self.folder, "vae", self.vae)

    @torch.inference_mode()
    def run(self, batch, progress=None) -> list[dict[str, torch.Tensor]]:
        """One item at a time (a batch may mix sizes), as the pipelines decode."""
        outputs = []
        for i, item in enumerate(batch):
            latents = item.inputs.get("latents")
            if latents is None:
                raise ValueError(
                    f"{item.request_id}: inputs lack 'latents' (got "
                    f"{sorted(item.inputs)}); the stage before must be a "
                    "'denoise' stage of the same checkpoint"
                )
            outputs.append({"image": decode(self.pipe, self.family, latents.to(self.device), item.params)})
            if progress is not None:
                progress(i + 1, len(batch))
        return outputs

    def limits(self) -> dict:
        return {"pixel_multiple": pixel_multiple(self.folder)}

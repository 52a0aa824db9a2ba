"""Stage kinds "diffusion" (the pipeline over the encoder stage's embeddings -> image),
"denoise" (the same with `output_type="latent"` -> latents) and "decode" (the family's VAE tail
alone: latents -> image).

The denoising stages call the family's pipeline itself, with the embeddings passed in
(`prompt_embeds=`, `negative_prompt_embeds=`, ...) and one CPU generator per item seeded with
its seed (diffusers draws each item's noise from its own generator, so it does not depend on the
batch). Text-to-image therefore equals `pipe(prompt=..., generator=torch.Generator()
.manual_seed(seed))` of the unsplit pipeline; image-to-image (a starting image in
INIT_IMAGE_INPUT, params.strength) equals the family's Img2Img pipeline, built from the same
components with `from_pipe`, called with `image=...` and `strength=...`. An edit family's
pipeline (Qwen-Image-Edit) takes its image to edit as `image=...` itself, one item a call.
Progress and abort go through the pipeline's `callback_on_step_end`. Only a sequence- or CFG-parallel split runs the
written-out loop (sampling.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import PIL.Image
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
from stagemesh.stage_service.models.diffusers_adapter.families import LARGEST_SIDE, Family, family_of, pixel_multiple
from stagemesh.stage_service.models.diffusers_adapter.folder import CheckpointFolder, FolderError, check_stage_folder
from stagemesh.stage_service.models.diffusers_adapter.loading import (
    checkpoint_dtype,
    import_diffusers,
    load_pipeline,
    load_transformer,
    refuse_unsupported,
    weight_files,
)
from stagemesh.stage_service.models.diffusers_adapter.parallel import for_sampling, runs_unconditional
from stagemesh.stage_service.models.diffusers_adapter.sampling import DEFAULT_STRENGTH, sample
from stagemesh.stage_service.models.parallel import ImageParallel
from stagemesh.stage_service.settings import DloOptions

# The warm-up's embeddings: the encoder stage's text length per pipeline (FLUX: T5 at 512; SD3:
# CLIP's 77 + T5's 256), for the families that hand on a prompt and a pooled embedding.
WARM_UP_TEXT_TOKENS = {"FluxPipeline": 512, "StableDiffusion3Pipeline": 333}
POOLED_EMBEDDINGS = ("prompt_embeds", "pooled_prompt_embeds")


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


def to_picture(pipe, decoded: torch.Tensor) -> torch.Tensor:
    """The VAE's output for one item [1, 3, H, W] -> the [H, W, 3] float32 image in [0, 1]."""
    return pipe.image_processor.postprocess(decoded, output_type="pt")[0].permute(1, 2, 0).float().detach()


def native_size(pipe, folder: CheckpointFolder) -> dict:
    """{"native_size": N}: the side the pipeline draws when a call leaves height and width unset
    (its default_sample_size latents times the VAE's scale: FLUX.1 and SD3 1024); {} where the
    pipeline names none. A shell without its transformer (a decode stage) falls back to 128
    latents where the full pipeline reads the transformer's sample_size (SD3): read from the
    folder's config instead."""
    sample, scale = getattr(pipe, "default_sample_size", None), getattr(pipe, "vae_scale_factor", None)
    if getattr(pipe, "transformer", None) is None and "transformer" in folder.components:
        try:
            sample = folder.component_config("transformer").get("sample_size", sample)
        except FolderError:
            pass
    if isinstance(sample, int) and isinstance(scale, int) and sample > 0 and scale > 0:
        return {"native_size": sample * scale}
    return {}


def _uniform(batch) -> bool:
    """Whether the items' inputs have the same names and shapes (one pipeline call for all)."""
    first = {name: tuple(t.shape) for name, t in batch[0].inputs.items()}
    return all({name: tuple(t.shape) for name, t in item.inputs.items()} == first for item in batch)


def _step_callback(progress):
    def on_step_end(pipe, step: int, timestep, tensors: dict) -> dict:
        progress(step + 1, pipe.num_timesteps)  # may raise: the pipeline call ends there
        return {}

    return on_step_end


class DenoiseRunner(RunnerBase):
    """kind "diffusion" decodes with the VAE; kind "denoise" hands latents to a "decode" stage."""

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
        self.family: Family = family_of(self.folder)
        # The negative embeddings and the starting image reach this stage only where the
        # family takes them.
        self.supports_negative_prompt = self.family.supports_negative_prompt
        self.supports_init_image = self.family.supports_image_input
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
        split = self.parallel.sp.split or self.parallel.cfg.split
        self.sampling_family = for_sampling(self.family, self.transformer, self.parallel) if split else None
        self._image_pipe: Any = None
        self._image_pipe_key = 0

    def image_pipeline(self):
        """The family's Img2Img pipeline over the same components (from_pipe shares them), built
        again whenever `self.pipe` holds another transformer than when it was built."""
        key = id(self.pipe.transformer)
        if self._image_pipe is None or self._image_pipe_key != key:
            cls = getattr(import_diffusers(), self.family.img2img_class or "")
            pipe = cls.from_pipe(self.pipe)
            pipe.set_progress_bar_config(disable=True)
            self._image_pipe, self._image_pipe_key = pipe, key
        return self._image_pipe

    def weight_files(self) -> list[WeightFile]:
        # Under DLO the streamed blocks belong to the offload engine; sleep manages the rest.
        streamed = self.offload.streamed if self.offload is not None else ()
        skip = tuple(f"{block.path}." for block in streamed)
        files = weight_files(self.folder, "transformer", self.transformer, skip)
        return files + weight_files(self.folder, "vae", self.pipe.vae)

    def device_holders(self) -> list:
        return [self.offload] if self.offload is not None else []

    def _embeddings(self, batch) -> dict:
        family = self.family
        guided = batch[0].params.guidance_scale > family.cfg_above
        needed = family.embeddings + (family.negative_embeddings if guided else ())
        for item in batch:
            missing = [n for n in needed if n not in item.inputs]
            if missing:
                raise ValueError(
                    f"{item.request_id}: inputs lack {missing} (got "
                    f"{sorted(item.inputs)}); the stage before must be an "
                    "'encoder' stage of the same checkpoint"
                )
        known = family.embeddings + family.negative_embeddings + family.optional_embeddings
        names = [n for n in known if n in batch[0].inputs]
        if family.ragged:
            return {n: [item.inputs[n].to(self.device) for item in batch] for n in names}
        return {n: torch.stack([item.inputs[n] for item in batch]).to(self.device) for n in names}

    @torch.inference_mode()
    def run(self, batch, progress=None) -> list[dict[str, torch.Tensor]]:
        """Items share size, steps, guidance and strength (the batch key); one pipeline call
        for the batch when their embeddings have one shape, else one call per item.
        `progress(step, steps run)` follows each step and may raise to abort."""
        if not batch:
            return []
        check_batch(batch)
        if self.family.edit_image:
            return self._run_edit(batch, progress)
        images, strength = starting_images(batch)
        if self.sampling_family is not None:
            return self._run_split(batch, images, strength, progress)
        if self.family.ragged or _uniform(batch):  # ragged: the pipeline takes a list
            return self._call(batch, images, strength, progress)
        outputs = []
        for i, item in enumerate(batch):
            outputs += self._call([item], None if images is None else images[i : i + 1], strength, progress)
        return outputs

    def _run_edit(self, batch, progress) -> list[dict[str, torch.Tensor]]:
        """One pipeline call an item: QwenImageEditPipeline scales a single image to its working
        size, while a list would go to its VAE unscaled."""
        images, _ = starting_images(batch)
        if images is None:
            raise ItemError(
                0,
                f"{batch[0].request_id}: inputs lack {INIT_IMAGE_INPUT!r}, the image "
                f"{self.family.pipeline_class} edits",
            )
        outputs = []
        for i, item in enumerate(batch):
            outputs += self._call([item], images[i : i + 1], 1.0, progress)
        return outputs

    def _call(self, batch, images, strength: float, progress) -> list[dict[str, torch.Tensor]]:
        kwargs = self.family.call_arguments(batch[0].params) | self._embeddings(batch)
        pipe = self.pipe
        if images is not None and self.family.edit_image:
            kwargs["image"] = PIL.Image.fromarray(images[0].cpu().numpy())
        elif images is not None:
            pipe = self.image_pipeline()
            kwargs.update(image=[PIL.Image.fromarray(image.cpu().numpy()) for image in images], strength=strength)
        if progress is not None:
            kwargs["callback_on_step_end"] = _step_callback(progress)
        out = pipe(
            generator=[torch.Generator("cpu").manual_seed(item.params.seed) for item in batch],
            output_type="pt" if self.decodes else "latent",
            return_dict=False,
            **kwargs,
        )[0]
        if self.decodes:
            return [{"image": picture.permute(1, 2, 0).float().detach()} for picture in out]
        return [{"latents": latents.detach()} for latents in out]

    def _run_split(self, batch, images, strength: float, progress) -> list[dict[str, torch.Tensor]]:
        """The written-out loop over this rank's share of a sequence- or CFG-parallel split."""
        params = batch[0].params
        if self.parallel.cfg.rank > 0 and not runs_unconditional(params.guidance_scale):
            return []  # no unconditional pass to run: rank 0 runs the batch alone
        generators = [torch.Generator("cpu").manual_seed(item.params.seed) for item in batch]
        embeds = self._embeddings(batch)
        assert self.sampling_family is not None
        latents = sample(self.pipe, self.sampling_family, embeds, params, generators, images, strength, progress)
        if not self.parallel.output:
            return []  # the output rank holds the same latents and answers
        if self.decodes:
            decode = self.family.decode
            return [{"image": to_picture(self.pipe, decode(self.pipe, lat[None], params))} for lat in latents]
        return [{"latents": lat.detach()} for lat in latents]

    def limits(self) -> dict:
        return {
            "pixel_multiple": pixel_multiple(self.folder),
            "max_size": LARGEST_SIDE,
            "requires_init_image": self.family.edit_image,
            **native_size(self.pipe, self.folder),
        }

    def warm_up_items(self, params) -> list[WorkItem] | None:
        """Zero embeddings shaped as the encoder stage sends them (its text length, the
        transformer's widths), the negative ones too where the family guides with them; None
        for a family whose shapes are not known here (it starts without a warm-up)."""
        family, config = self.family, self.transformer.config
        tokens = WARM_UP_TEXT_TOKENS.get(family.pipeline_class)
        width = getattr(config, "joint_attention_dim", None)
        pooled_width = getattr(config, "pooled_projection_dim", None)
        if tokens is None or width is None or pooled_width is None or family.embeddings != POOLED_EMBEDDINGS:
            return None
        text = torch.zeros(tokens, width, dtype=self.transformer.dtype)
        pooled = torch.zeros(pooled_width, dtype=self.transformer.dtype)
        inputs = {"prompt_embeds": text, "pooled_prompt_embeds": pooled}
        if params.guidance_scale > family.cfg_above:
            inputs |= dict(zip(family.negative_embeddings, (text, pooled), strict=False))
        return [WorkItem("warm-up", params, inputs)]


class DecodeRunner(RunnerBase):
    """kind "decode": the family's VAE tail as its own stage, after a "denoise" stage."""

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
            decoded = self.family.decode(self.pipe, latents[None].to(self.device), item.params)
            outputs.append({"image": to_picture(self.pipe, decoded)})
            if progress is not None:
                progress(i + 1, len(batch))
        return outputs

    def limits(self) -> dict:
        return {
            "pixel_multiple": pixel_multiple(self.folder),
            "max_size": LARGEST_SIDE,
            **native_size(self.pipe, self.folder),
        }

"""Stage kinds "diffusion" (the pipeline over the encoder stage's embeddings -> image),
"denoise" (the same with `output_type="latent"` -> latents) and "decode" (the family's VAE tail
alone: latents -> image).

The denoising stages call the family's pipeline itself, with the embeddings passed in
(`prompt_embeds=`, `negative_prompt_embeds=`, ...) and one CPU generator per item seeded with
its seed (diffusers draws each item's noise from its own generator, so it does not depend on the
batch). Text-to-image therefore equals `pipe(prompt=..., generator=torch.Generator()
.manual_seed(seed))` of the unsplit pipeline; image-to-image (a starting image in
INIT_IMAGE_INPUT, params.strength) equals the family's Img2Img pipeline, built from the same
components with `from_pipe`, called with `image=...` and `strength=...`. Progress and abort go
through the pipeline's `callback_on_step_end`. Only a sequence- or CFG-parallel split runs the
written-out loop (sampling.py).
"""

from __future__ import annotations

from pathlib import Path

import PIL.Image
import torch

from stagemesh.stage_service.models.contract import INIT_IMAGE_INPUT, ItemError, RunnerBase, WeightFile, check_batch
from stagemesh.stage_service.models.diffusers_adapter.families import Family, family_of, pixel_multiple
from stagemesh.stage_service.models.diffusers_adapter.folder import check_stage_folder
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
        self.transformer, self.offload = load_transformer(self.folder, self.family, device, dtype, opts)
        self.pipe = load_pipeline(self.folder, ["scheduler", "vae"], dtype, transformer=self.transformer)
        self.pipe.vae.to(device).eval().requires_grad_(False)
        # Sequence / CFG parallel: every rank samples; rank 0 alone decodes and answers.
        self.parallel = parallel or ImageParallel()
        split = self.parallel.sp.split or self.parallel.cfg.split
        self.sampling_family = for_sampling(self.family, self.transformer, self.parallel) if split else None

    def image_pipeline(self):
        """The family's Img2Img pipeline over the same components (built on each use, so it
        always shares whatever transformer `self.pipe` holds now)."""
        cls = getattr(import_diffusers(), self.family.img2img_class or "")
        pipe = cls.from_pipe(self.pipe)
        pipe.set_progress_bar_config(disable=True)
        return pipe

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
        images, strength = starting_images(batch)
        if self.sampling_family is not None:
            return self._run_split(batch, images, strength, progress)
        if self.family.ragged or _uniform(batch):  # ragged: the pipeline takes a list
            return self._call(batch, images, strength, progress)
        outputs = []
        for i, item in enumerate(batch):
            outputs += self._call([item], None if images is None else images[i : i + 1], strength, progress)
        return outputs

    def _call(self, batch, images, strength: float, progress) -> list[dict[str, torch.Tensor]]:
        kwargs = self.family.call_arguments(batch[0].params) | self._embeddings(batch)
        pipe = self.pipe
        if images is not None:
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
        return {"pixel_multiple": pixel_multiple(self.folder)}


class DecodeRunner(RunnerBase):
    """kind "decode": the family's VAE tail as its own stage, after a "denoise" stage."""

    kind = "decode"

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        self.folder = check_stage_folder(model_dir, self.kind)
        self.family = family_of(self.folder)
        self.device = device
        self.pipe = load_pipeline(self.folder, ["vae"], checkpoint_dtype(self.folder))
        self.vae = self.pipe.vae.to(device).eval().requires_grad_(False)

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
        return {"pixel_multiple": pixel_multiple(self.folder)}

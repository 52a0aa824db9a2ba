"""Stage kinds "diffusion" (transformer + scheduler loop + VAE decode -> image), "denoise" (the
same without the VAE -> latents) and "decode" (the VAE alone: latents -> image).

The denoising stage calls the pipeline itself with the encoder stage's embeddings, one CPU
generator per request seeded with its seed, and a step callback for progress; so its image equals
`pipe(prompt=..., generator=torch.Generator().manual_seed(seed))` of the unsplit pipeline.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stagemesh.stage_service.models.contract import RunnerBase, WeightFile, check_batch
from stagemesh.stage_service.models.diffusers_adapter.families import family_of, pixel_multiple, vae_scale_factor
from stagemesh.stage_service.models.diffusers_adapter.folder import check_stage_folder
from stagemesh.stage_service.models.diffusers_adapter.loading import (
    checkpoint_dtype,
    load_pipeline,
    load_transformer,
    refuse_unsupported,
    weight_files,
)
from stagemesh.stage_service.offload.config import DloOptions

REQUIRED_INPUTS = ("prompt_embeds", "pooled_prompt_embeds")
OPTIONAL_INPUTS = ("negative_prompt_embeds", "negative_pooled_prompt_embeds")


def _image(t: torch.Tensor) -> torch.Tensor:
    """[3, H, W] in [0, 1] -> the [H, W, 3] float32 image the gateway encodes."""
    return t.permute(1, 2, 0).float().detach()


class DenoiseRunner(RunnerBase):
    """kind "diffusion" decodes with the VAE; kind "denoise" hands latents to a "decode" stage."""

    def __init__(
        self, model_dir: Path, device: str = "cpu", dlo: DloOptions | None = None, kind: str = "diffusion"
    ) -> None:
        opts = dlo or DloOptions()
        refuse_unsupported(opts)
        self.kind = kind
        self.decodes = kind == "diffusion"
        self.device = device
        self.folder = check_stage_folder(model_dir, kind)
        self.family = family_of(self.folder)
        dtype = checkpoint_dtype(self.folder)
        self.transformer, self.offload = load_transformer(self.folder, self.family, device, dtype, opts)
        keep = ["scheduler", "vae"] if self.decodes else ["scheduler"]
        self.pipe = load_pipeline(self.folder, keep, dtype, transformer=self.transformer)
        if self.decodes:
            self.pipe.vae.to(device).eval().requires_grad_(False)
        else:
            # Without a VAE the pipeline falls back to a scale of 8; latents must match the VAE.
            self.pipe.vae_scale_factor = vae_scale_factor(self.folder)

    def weight_files(self) -> list[WeightFile]:
        # Under DLO the streamed blocks belong to the offload engine; sleep manages the rest.
        streamed = self.offload.streamed if self.offload is not None else ()
        skip = tuple(f"{block.path}." for block in streamed)
        files = weight_files(self.folder, "transformer", self.transformer, skip)
        if self.decodes:
            files += weight_files(self.folder, "vae", self.pipe.vae)
        return files

    def device_holders(self) -> list:
        return [self.offload] if self.offload is not None else []

    def _inputs(self, batch) -> dict[str, torch.Tensor]:
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
        """The whole batch as one pipeline call; items share shape, steps and guidance.
        `progress(step, num_inference_steps)` follows each step and may raise to abort."""
        if not batch:
            return []
        check_batch(batch)
        head = batch[0]
        steps = head.params.num_inference_steps

        def on_step(pipe, i, t, tensors):
            progress(i + 1, steps)
            return tensors

        out = self.pipe(
            **self._inputs(batch),
            height=head.params.height,
            width=head.params.width,
            num_inference_steps=steps,
            guidance_scale=head.params.guidance_scale,
            generator=[torch.Generator("cpu").manual_seed(item.params.seed) for item in batch],
            output_type="pt" if self.decodes else "latent",
            callback_on_step_end=on_step if progress is not None else None,
            return_dict=False,
        )[0]
        if self.decodes:
            return [{"image": _image(img)} for img in out]
        return [{"latents": lat.detach()} for lat in out]

    def limits(self) -> dict:
        return {"pixel_multiple": pixel_multiple(self.folder)}


class DecodeRunner(RunnerBase):
    """kind "decode": the VAE as its own stage, after a "denoise" stage."""

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
        config = self.vae.config
        for i, item in enumerate(batch):
            latents = item.inputs.get("latents")
            if latents is None:
                raise ValueError(
                    f"{item.request_id}: inputs lack 'latents' (got "
                    f"{sorted(item.inputs)}); the stage before must be a "
                    "'denoise' stage of the same checkpoint"
                )
            latents = latents[None].to(self.device)
            if self.family.unpack is not None:
                latents = self.family.unpack(self.pipe, latents, item.params.height, item.params.width)
            latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
            image = self.vae.decode(latents, return_dict=False)[0]
            image = self.pipe.image_processor.postprocess(image, output_type="pt")
            outputs.append({"image": _image(image[0])})
            if progress is not None:
                progress(i + 1, len(batch))
        return outputs

    def limits(self) -> dict:
        return {"pixel_multiple": pixel_multiple(self.folder)}

"""The denoising loop written out, which sequence and CFG parallelism split (parallel.py); a
stage without such a split calls the pipeline itself. The starting latents (noise for
text-to-image; for image-to-image the VAE-encoded starting image, noised to the timestep where
`strength` starts), then the denoising loop over the scheduler's remaining timesteps.

Every random draw comes from the item's own generator, in the order the pipelines draw
(image-to-image: the VAE's latent sample, then the noise), so an item's noise does not depend on
the batch it runs in and equals the unsplit pipeline's for the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import PIL.Image
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.contract import Progress
from stagemesh.stage_service.models.diffusers_adapter.split_families import SamplingFamily, Tensors

# Image-to-image without an explicit strength (the pipelines' documented default).
DEFAULT_STRENGTH = 0.8


def skipped_steps(steps: int, strength: float) -> int:
    """How many leading steps of a `steps`-step schedule image-to-image skips: it starts at the
    noise level `strength` names (1: pure noise, every step). Any strength in (0, 1] leaves at
    least one step."""
    return int(max(steps - min(steps * strength, steps), 0))


def noise(shape: Sequence[int], generators: list[torch.Generator], dtype: torch.dtype, device) -> torch.Tensor:
    """One standard-normal [1, *shape] draw per generator, on the generator's device."""
    draws = [torch.randn((1, *shape), generator=g, device=g.device, dtype=dtype) for g in generators]
    return torch.cat(draws).to(device)


def encode_images(pipe, images: list[torch.Tensor], generators: list[torch.Generator], dtype, device):
    """uint8 [H, W, 3] RGB images -> scaled VAE latents [B, C, h, w], one sample per generator."""
    sampled = []
    for image, generator in zip(images, generators):
        # As a PIL image, the form diffusers' users pass: the processor then hands the VAE a
        # channels-last tensor, whose convolutions round differently from a contiguous one's.
        picture = PIL.Image.fromarray(image.cpu().numpy())
        pixels = pipe.image_processor.preprocess(picture, height=picture.height, width=picture.width)
        sampled.append(pipe.vae.encode(pixels.to(device=device, dtype=dtype)).latent_dist.sample(generator))
    config = pipe.vae.config
    return (torch.cat(sampled) - (config.shift_factor or 0.0)) * config.scaling_factor


def sample(
    pipe,
    family: SamplingFamily,
    embeds: Tensors,
    params: Params,
    generators: list[torch.Generator],
    images: list[torch.Tensor] | None = None,
    strength: float = DEFAULT_STRENGTH,
    progress: Progress | None = None,
) -> torch.Tensor:
    """Denoised latents in the transformer's layout, one per generator. With `images` (and a
    `strength`), image-to-image: the loop runs the schedule's last steps from the noised images.
    `progress(step, steps run)` follows each step and may raise to abort."""
    transformer, scheduler = pipe.transformer, pipe.scheduler
    text = embeds["prompt_embeds"]
    device, dtype = text.device, text.dtype
    h = family.latent_size(params.height, pipe.vae_scale_factor)
    w = family.latent_size(params.width, pipe.vae_scale_factor)
    family.set_schedule(scheduler, params.num_inference_steps, h, w, transformer, device)
    start = 0 if images is None else skipped_steps(params.num_inference_steps, strength)
    start *= scheduler.order
    timesteps = scheduler.timesteps[start:]
    scheduler.set_begin_index(start)
    shape = (family.latent_channels(transformer), h, w)
    if images is None:
        latents = noise(shape, generators, dtype, device)
    else:
        clean = encode_images(pipe, images, generators, dtype, device)
        first = timesteps[:1].repeat(len(images))
        latents = scheduler.scale_noise(clean, first, noise(shape, generators, dtype, device))
    latents = family.to_model(latents)
    cond = family.conditioning(transformer, embeds, params.guidance_scale, h, w)
    for i, t in enumerate(timesteps):
        velocity = family.predict(transformer, latents, t, cond, params.guidance_scale)
        latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
        if progress is not None:
            progress(i + 1, len(timesteps))
    return latents

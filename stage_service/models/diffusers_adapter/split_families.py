"""FLUX.1's and SD3's denoising written out, for what calling the pipeline cannot do: split one
evaluation across ranks (sequence parallelism, CFG parallelism; parallel.py wraps these). What
differs between the two: the latent layout the transformer takes, the noise schedule, one guided
transformer evaluation. The sampling loop itself is sampling.py.

Each method calls the components' public interfaces (the transformer's forward, the scheduler's
`set_timesteps`) with the values the pipeline's own `__call__` passes, so a split stage's image
equals that of the unsplit pipeline within float rounding.
"""

from __future__ import annotations

from typing import Any

import torch

Tensors = dict[str, torch.Tensor]


def _shift_for_length(seq_len: int, config: Any, max_shift_default: float) -> float:
    """Resolution-dependent schedule shift: linear in the number of image tokens between the
    scheduler's (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", max_shift_default)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return seq_len * slope + (base_shift - slope * base_len)


class SamplingFamily:
    pipeline_class = ""
    packs_2x2 = False  # latents are packed in 2x2 patches (sizes a multiple of 2 * vae scale)
    guided_inputs: tuple[str, ...] = ()  # embeddings the sampler needs when guidance_scale > 1

    def latent_size(self, pixels: int, vae_scale: int) -> int:
        return pixels // vae_scale

    def latent_channels(self, transformer) -> int:
        return int(transformer.config.in_channels)

    def to_model(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE-space latents [B, C, h, w] -> the layout the transformer takes."""
        return latents

    def to_vae(self, latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """The inverse of `to_model`, for a latent grid of h x w."""
        return latents

    def set_schedule(self, scheduler, steps: int, h: int, w: int, transformer, device) -> None:
        raise NotImplementedError

    def conditioning(self, transformer, embeds: Tensors, guidance_scale: float, h: int, w: int) -> Tensors:
        """What every step passes to the transformer beside the latents, built once per batch."""
        raise NotImplementedError

    def predict(self, transformer, latents: torch.Tensor, t: torch.Tensor, cond: Tensors, guidance_scale: float):
        """The guided velocity at timestep `t`."""
        raise NotImplementedError


class FluxFamily(SamplingFamily):
    """FLUX.1: latents packed in 2x2 patches with positional ids; the guidance scale is an
    embedding the transformer was distilled with (no unconditional pass, so no negative prompt)."""

    pipeline_class = "FluxPipeline"
    packs_2x2 = True

    def latent_size(self, pixels: int, vae_scale: int) -> int:
        return 2 * (pixels // (vae_scale * 2))

    def latent_channels(self, transformer) -> int:
        return int(transformer.config.in_channels) // 4

    def to_model(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return patches.reshape(b, (h // 2) * (w // 2), c * 4)

    def to_vae(self, latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, _, packed = latents.shape
        c = packed // 4
        grid = latents.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return grid.reshape(b, c, h, w)

    def set_schedule(self, scheduler, steps: int, h: int, w: int, transformer, device) -> None:
        import numpy as np

        mu = _shift_for_length((h // 2) * (w // 2), scheduler.config, 1.15)
        if scheduler.config.get("use_flow_sigmas"):
            scheduler.set_timesteps(steps, device=device, mu=mu)
        else:
            # FLUX's own sigmas, linear from 1 to 1/steps, shifted by the scheduler.
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device=device, mu=mu)

    def conditioning(self, transformer, embeds: Tensors, guidance_scale: float, h: int, w: int) -> Tensors:
        text = embeds["prompt_embeds"]
        device, dtype = text.device, text.dtype
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        cond = {
            "encoder_hidden_states": text,
            "pooled_projections": embeds["pooled_prompt_embeds"],
            "txt_ids": torch.zeros(text.shape[1], 3, device=device, dtype=dtype),
            "img_ids": ids.reshape(-1, 3).to(device=device, dtype=dtype),
        }
        if transformer.config.guidance_embeds:
            cond["guidance"] = torch.full([1], guidance_scale, device=device, dtype=torch.float32).expand(text.shape[0])
        return cond

    def predict(self, transformer, latents: torch.Tensor, t: torch.Tensor, cond: Tensors, guidance_scale: float):
        # The transformer takes the timestep in [0, 1], in the latents' dtype.
        timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
        return transformer(hidden_states=latents, timestep=timestep, return_dict=False, **cond)[0]


class SD3Family(SamplingFamily):
    """Stable Diffusion 3: classifier-free guidance above guidance_scale 1, unconditional on the
    negative prompt ("" when none)."""

    pipeline_class = "StableDiffusion3Pipeline"
    guided_inputs = ("negative_prompt_embeds", "negative_pooled_prompt_embeds")

    def set_schedule(self, scheduler, steps: int, h: int, w: int, transformer, device) -> None:
        extra = {}
        if scheduler.config.get("use_dynamic_shifting"):
            patch = transformer.config.patch_size
            extra["mu"] = _shift_for_length((h // patch) * (w // patch), scheduler.config, 1.16)
        scheduler.set_timesteps(steps, device=device, **extra)

    def conditioning(self, transformer, embeds: Tensors, guidance_scale: float, h: int, w: int) -> Tensors:
        text, pooled = embeds["prompt_embeds"], embeds["pooled_prompt_embeds"]
        if guidance_scale > 1:  # one pass over [unconditional; conditional]
            text = torch.cat([embeds["negative_prompt_embeds"], text])
            pooled = torch.cat([embeds["negative_pooled_prompt_embeds"], pooled])
        return {"encoder_hidden_states": text, "pooled_projections": pooled}

    def predict(self, transformer, latents: torch.Tensor, t: torch.Tensor, cond: Tensors, guidance_scale: float):
        guided = guidance_scale > 1
        both = torch.cat([latents, latents]) if guided else latents
        out = transformer(hidden_states=both, timestep=t.expand(both.shape[0]), return_dict=False, **cond)[0]
        if not guided:
            return out
        uncond, text = out.chunk(2)
        return uncond + guidance_scale * (text - uncond)


# The families whose denoising sequence or CFG parallelism splits, by pipeline class.
SPLIT: dict[str, SamplingFamily] = {f.pipeline_class: f for f in (FluxFamily(), SD3Family())}

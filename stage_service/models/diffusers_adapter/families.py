"""What differs between pipeline classes: how a prompt becomes named embeddings, the latent
layout the transformer takes, the noise schedule, one guided transformer evaluation, which block
lists stream under DLO, and the pixel multiple. The sampling loop itself is shared (sampling.py).

Each method calls the components' public interfaces (`encode_prompt`, the transformer's forward,
the scheduler's `set_timesteps`) with the values the pipeline's own `__call__` passes, so a
stage's image equals that of the unsplit pipeline for the same seed.
"""

from __future__ import annotations

from typing import Any

import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.diffusers_adapter.folder import CheckpointFolder, FolderError

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


class Family:
    pipeline_class = ""
    block_attrs: tuple[str, ...] = ()  # the transformer's block lists, in execution order
    packs_2x2 = False  # latents are packed in 2x2 patches (sizes a multiple of 2 * vae scale)
    guided_inputs: tuple[str, ...] = ()  # embeddings the sampler needs when guidance_scale > 1
    supports_negative_prompt = False
    negative_prompt_refusal = ""  # why not, where it is not supported
    # Video families run the pipeline itself (video.py); the sampling methods below are the
    # image families' only.
    video = False

    def offload_plan(self):
        from stagemesh.stage_service.offload.plan import OffloadPlan

        # Any block list may keep its leading blocks resident (dlo_resident_layers).
        return OffloadPlan(block_attrs={"": self.block_attrs}, resident_paths=self.block_attrs)

    def encode(self, pipe, params: Params, device) -> Tensors:
        """Named [1, ...] embeddings of one request's prompt (and negative prompt)."""
        raise NotImplementedError

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


class FluxFamily(Family):
    """FLUX.1: latents packed in 2x2 patches with positional ids; the guidance scale is an
    embedding the transformer was distilled with (no unconditional pass, so no negative prompt)."""

    pipeline_class = "FluxPipeline"
    block_attrs = ("transformer_blocks", "single_transformer_blocks")
    packs_2x2 = True
    negative_prompt_refusal = "its guidance scale is distilled into the model, which has no unconditional pass"

    def encode(self, pipe, params: Params, device) -> Tensors:
        # FluxPipeline.__call__ defaults: prompt_2 = prompt, max_sequence_length 512.
        embeds, pooled, _text_ids = pipe.encode_prompt(
            prompt=params.prompt, prompt_2=None, device=device, num_images_per_prompt=1, max_sequence_length=512
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

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


class SD3Family(Family):
    """Stable Diffusion 3: classifier-free guidance above guidance_scale 1, unconditional on the
    negative prompt ("" when none)."""

    pipeline_class = "StableDiffusion3Pipeline"
    block_attrs = ("transformer_blocks",)
    guided_inputs = ("negative_prompt_embeds", "negative_pooled_prompt_embeds")
    supports_negative_prompt = True

    def encode(self, pipe, params: Params, device) -> Tensors:
        guided = params.guidance_scale > 1
        out = pipe.encode_prompt(
            prompt=params.prompt,
            prompt_2=None,
            prompt_3=None,
            negative_prompt=params.negative_prompt,  # unused unless guided; "" is the empty prompt
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=guided,
            clip_skip=None,
            max_sequence_length=256,
        )
        names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
        return {n: t for n, t in zip(names, out) if t is not None}

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


class WanFamily(Family):
    """Wan 2.1 / 2.2 text-to-video: one UMT5 encoder; the diffusion stage runs WanPipeline with
    the embeddings passed in (video.py), over `transformer` and, for Wan 2.2's two experts, the
    low-noise `transformer_2` below boundary_ratio. Classifier-free guidance above 1, on the
    negative prompt ("" when none)."""

    pipeline_class = "WanPipeline"
    block_attrs = ("blocks",)
    guided_inputs = ("negative_prompt_embeds",)
    supports_negative_prompt = True
    video = True
    experts = ("transformer", "transformer_2")
    takes_image = False  # the first frame, image-to-video
    # WanPipeline.__call__'s defaults: 81 frames at 16 fps (the Wan 2.2 A14B exports).
    default_num_frames = 81
    default_fps = 16

    def encode(self, pipe, params: Params, device) -> Tensors:
        # As WanPipeline.__call__ calls it: max_sequence_length 512, guided above scale 1.
        embeds, negative = pipe.encode_prompt(
            prompt=params.prompt,
            negative_prompt=params.negative_prompt or None,
            do_classifier_free_guidance=params.guidance_scale > 1,
            num_videos_per_prompt=1,
            max_sequence_length=512,
            device=device,
        )
        named = {"prompt_embeds": embeds}
        if negative is not None:
            named["negative_prompt_embeds"] = negative
        return named


class WanImageToVideoFamily(WanFamily):
    """Wan 2.2 image-to-video: the start image (init_image) reaches the diffusion stage, whose
    pipeline VAE-encodes it as the first frame (Wan 2.1's CLIP image encoder is not served)."""

    pipeline_class = "WanImageToVideoPipeline"
    takes_image = True


FAMILIES: dict[str, Family] = {
    f.pipeline_class: f for f in (FluxFamily(), SD3Family(), WanFamily(), WanImageToVideoFamily())
}


def family_of(folder: CheckpointFolder) -> Family:
    try:
        return FAMILIES[folder.pipeline_class]
    except KeyError:
        raise FolderError(
            f"checkpoint {folder.path}: pipeline class {folder.pipeline_class!r} "
            f"is not supported; supported: {sorted(FAMILIES)}"
        ) from None


def vae_scale_factor(folder: CheckpointFolder) -> int:
    """As the pipelines compute it: 2 ** (number of VAE resolution levels - 1)."""
    return 2 ** (len(folder.component_config("vae")["block_out_channels"]) - 1)


def pixel_multiple(folder: CheckpointFolder) -> int:
    """Width and height must be multiples of this (the pipelines' own check_inputs rule)."""
    family = family_of(folder)
    if family.video:  # the VAE's spatial stride times the transformer's patch
        vae = folder.component_config("vae")
        patch = folder.component_config("transformer")["patch_size"]
        return int(vae.get("scale_factor_spatial", 8)) * int(patch[1])
    if family.packs_2x2:
        patch = 2
    elif "transformer" in folder.components and (folder.path / "transformer").is_dir():
        patch = int(folder.component_config("transformer").get("patch_size", 2))
    else:
        patch = 2
    return vae_scale_factor(folder) * patch

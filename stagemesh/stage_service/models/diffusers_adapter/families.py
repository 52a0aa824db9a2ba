"""What differs between pipeline classes: how a prompt becomes named embeddings, which block
lists of the transformer stream under DLO, how latents reach the VAE, and the pixel multiple.

The encode functions call the pipeline's own `encode_prompt` with the arguments its `__call__`
uses, so the embeddings (and the image) equal those of the unsplit pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stagemesh.stage_service.models.diffusers_adapter.folder import CheckpointFolder, FolderError

Encode = Callable[..., dict]  # (pipe, prompt, guidance_scale, device) -> named [1, ...] tensors


@dataclass(frozen=True)
class Family:
    pipeline_class: str
    block_attrs: tuple[str, ...]  # the transformer's block lists, in execution order
    encode: Encode
    unpack: Callable | None  # (pipe, latents, height, width) -> VAE-space latents; None: as is
    packs_2x2: bool  # latents are packed in 2x2 patches (sizes a multiple of 2 * vae scale)
    guided_inputs: tuple[str, ...] = ()  # embeddings the pipeline needs when guidance_scale > 1

    def offload_plan(self):
        from stagemesh.stage_service.offload.plan import OffloadPlan

        # Any block list may keep its leading blocks resident (dlo_resident_layers).
        return OffloadPlan(block_attrs={"": self.block_attrs}, resident_paths=self.block_attrs)


def _encode_flux(pipe, prompt: str, guidance_scale: float, device) -> dict:
    # FluxPipeline.__call__ defaults: prompt_2 = prompt, max_sequence_length 512, no true CFG.
    embeds, pooled, _text_ids = pipe.encode_prompt(
        prompt=prompt, prompt_2=None, device=device, num_images_per_prompt=1, max_sequence_length=512
    )
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def _encode_sd3(pipe, prompt: str, guidance_scale: float, device) -> dict:
    # StableDiffusion3Pipeline.__call__ guides when guidance_scale > 1 (negative prompt "").
    out = pipe.encode_prompt(
        prompt=prompt,
        prompt_2=None,
        prompt_3=None,
        device=device,
        num_images_per_prompt=1,
        do_classifier_free_guidance=guidance_scale > 1,
        clip_skip=None,
        max_sequence_length=256,
    )
    names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    return {n: t for n, t in zip(names, out) if t is not None}


def _unpack_flux(pipe, latents, height: int, width: int):
    return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)


FAMILIES = {
    "FluxPipeline": Family(
        "FluxPipeline", ("transformer_blocks", "single_transformer_blocks"), _encode_flux, _unpack_flux, packs_2x2=True
    ),
    "StableDiffusion3Pipeline": Family(
        "StableDiffusion3Pipeline",
        ("transformer_blocks",),
        _encode_sd3,
        None,
        packs_2x2=False,
        guided_inputs=("negative_prompt_embeds", "negative_pooled_prompt_embeds"),
    ),
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
    if family.packs_2x2:
        patch = 2
    elif "transformer" in folder.components and (folder.path / "transformer").is_dir():
        patch = int(folder.component_config("transformer").get("patch_size", 2))
    else:
        patch = 2
    return vae_scale_factor(folder) * patch

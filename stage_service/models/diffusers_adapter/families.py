"""Each served pipeline class as a declaration: its class names, which components each stage
loads, how the encoder stage calls the pipeline's `encode_prompt`, which keywords hand the
embeddings back to the pipeline's `__call__`, what it supports, the transformer's block lists
that stream under DLO, and the VAE tail a separate "decode" stage runs.

The diffusion stage calls the pipeline itself with the embeddings passed in, so its image is the
unsplit pipeline's by construction. Only sequence and CFG parallelism need the denoising loop
written out (split_families.py + sampling.py), and only FLUX.1 and SD3 declare them. Video
families (Wan) declare `video`: their denoising and decode stages are video.py's runners, which
call the pipeline the same way and hand on frames.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.models.diffusers_adapter.folder import CheckpointFolder, FolderError

Tensors = dict[str, Any]  # name -> tensor, or a list of per-prompt tensors (Z-Image)
Encode = Callable[..., Tensors]  # (pipe, params, device[, image=the edit family's PIL image])
Decode = Callable[[Any, torch.Tensor, Params], torch.Tensor]


@dataclass(frozen=True)
class Family:
    name: str  # what `stagemesh synthesize --family` and the docs call it
    pipeline_class: str
    encode: Encode  # (pipe, params, device) -> named [1, ...] embeddings of one request
    decode: Decode  # (pipe, latents [B, ...] as output_type="latent" gives them, params) -> VAE output
    embeddings: tuple[str, ...]  # what the encoder stage always hands on
    # what it hands on when the request guides (those present are passed to the pipeline)
    negative_embeddings: tuple[str, ...] = ()
    optional_embeddings: tuple[str, ...] = ()  # handed on when the encoder produced them
    guidance_keyword: str = "guidance_scale"  # the __call__ keyword params.guidance_scale fills
    cfg_above: float = 1.0  # guidance scales above this run the unconditional pass
    img2img_class: str | None = None  # the Img2Img pipeline image-to-image runs (from_pipe)
    supports_negative_prompt: bool = False
    negative_prompt_refusal: str = ""  # why not, where it is not supported
    block_attrs: tuple[str, ...] = ()  # the transformer's block lists, in execution order
    packs_2x2: bool = False  # sizes a multiple of 2 * the VAE scale
    ragged: bool = False  # embeddings go to the pipeline as a list of per-prompt tensors
    sequence_parallel: bool = False
    cfg_parallel: bool = False
    components: dict[str, tuple[str, ...]] = field(default_factory=dict)  # stage kind -> extra loads
    # Video: the pipeline returns frames (video.py); its transformers (Wan 2.2's two experts, the
    # second below boundary_ratio) each resident or under DLO; whether init_image is the first
    # frame (image-to-video, required); the pipeline's own num_frames and the rate it is shown at.
    video: bool = False
    experts: tuple[str, ...] = ("transformer",)
    start_image: bool = False
    default_num_frames: int = 0
    default_fps: int = 0
    # Components the encoder stage builds from the folder (its path) instead of from_pretrained,
    # where the class model_index.json names cannot be built here (FLUX.2 [dev]'s processor).
    built_components: Callable[[Path], dict[str, Any]] | None = None
    # An edit model (Qwen-Image-Edit): init_image is the image to edit, required, with no
    # strength. The encoder stage reads it with the prompt (encode gets it as image=); the
    # denoising stage hands it to the pipeline as image=, whose VAE encodes it.
    edit_image: bool = False

    @property
    def supports_image_input(self) -> bool:
        return self.img2img_class is not None or self.edit_image

    def offload_plan(self):
        from stagemesh.stage_service.offload.plan import OffloadPlan

        # Any block list may keep its leading blocks resident (dlo_resident_layers).
        return OffloadPlan(block_attrs={"": self.block_attrs}, resident_paths=self.block_attrs)

    def call_arguments(self, params: Params) -> dict[str, Any]:
        """The keywords of the pipeline's __call__ that come from the request's params."""
        arguments = {
            "height": params.height,
            "width": params.width,
            "num_inference_steps": params.num_inference_steps,
            self.guidance_keyword: params.guidance_scale,
        }
        if self.video:
            arguments["num_frames"] = params.num_frames
        return arguments


def _named(names: tuple[str, ...], values) -> Tensors:
    return {n: v for n, v in zip(names, values) if v is not None and not (isinstance(v, list) and not v)}


def _encode_flux(pipe, params: Params, device) -> Tensors:
    # FluxPipeline.__call__'s defaults: prompt_2 = prompt, max_sequence_length 512.
    embeds, pooled, _text_ids = pipe.encode_prompt(
        prompt=params.prompt, prompt_2=None, device=device, num_images_per_prompt=1, max_sequence_length=512
    )
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def _encode_sd3(pipe, params: Params, device) -> Tensors:
    out = pipe.encode_prompt(
        prompt=params.prompt,
        prompt_2=None,
        prompt_3=None,
        negative_prompt=params.negative_prompt,  # unused unless guided; "" is the empty prompt
        device=device,
        num_images_per_prompt=1,
        do_classifier_free_guidance=params.guidance_scale > 1,
        clip_skip=None,
        max_sequence_length=256,
    )
    names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    return _named(names, out)


def _encode_zimage(pipe, params: Params, device) -> Tensors:
    # Lists of one [tokens, dim] tensor each: Z-Image keeps every prompt at its own length.
    embeds, negative = pipe.encode_prompt(
        prompt=params.prompt,
        device=device,
        do_classifier_free_guidance=params.guidance_scale > 0,  # ZImagePipeline's own rule
        negative_prompt=params.negative_prompt or None,
        max_sequence_length=512,
    )
    return _named(("prompt_embeds", "negative_prompt_embeds"), (embeds, negative))


def _encode_qwen(pipe, params: Params, device, **image) -> Tensors:
    def encode(prompt: str, prefix: str) -> Tensors:
        embeds, mask = pipe.encode_prompt(prompt=prompt, device=device, max_sequence_length=512, **image)
        # encode_prompt drops an all-ones mask; handed on, it spares the pipeline's warning and
        # the pipeline drops it again, so the call is the same.
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {f"{prefix}prompt_embeds": embeds, f"{prefix}prompt_embeds_mask": mask}

    out = encode(params.prompt, "")
    # True CFG runs only with a negative prompt (QwenImagePipeline's rule), so it is encoded then.
    if params.negative_prompt and params.guidance_scale > 1:
        out.update(encode(params.negative_prompt, "negative_"))
    return out


def _encode_qwen_edit(pipe, params: Params, device, image) -> Tensors:
    """As QwenImageEditPipeline.__call__ encodes: the prompt (and the negative one) read with the
    input image scaled to about 1024 x 1024 pixels at its aspect ratio."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(1024 * 1024, image.size[0] / image.size[1])
    return _encode_qwen(pipe, params, device, image=pipe.image_processor.resize(image, height, width))


def _encode_flux2_klein(pipe, params: Params, device) -> Tensors:
    embeds, _text_ids = pipe.encode_prompt(prompt=params.prompt, device=device, max_sequence_length=512)
    out = {"prompt_embeds": embeds}
    if params.guidance_scale > 1 and not pipe.config.is_distilled:
        # Flux2KleinPipeline's unconditional input is always the empty prompt.
        out["negative_prompt_embeds"] = pipe.encode_prompt(prompt="", device=device, max_sequence_length=512)[0]
    return out


def _encode_flux2(pipe, params: Params, device) -> Tensors:
    # Flux2Pipeline.__call__'s defaults: 512 tokens, Mistral3's hidden states 10, 20 and 30.
    embeds, _text_ids = pipe.encode_prompt(
        prompt=params.prompt, device=device, max_sequence_length=512, text_encoder_out_layers=(10, 20, 30)
    )
    return {"prompt_embeds": embeds}


def _flux2_processor(path: Path) -> dict[str, Any]:
    from stagemesh.stage_service.models.diffusers_adapter.prompt_processor import load_text_processor

    return {"tokenizer": load_text_processor(path / "tokenizer")}


def _qwen_vl_processor(path: Path) -> dict[str, Any]:
    from stagemesh.stage_service.models.diffusers_adapter.vl_processor import load_processor

    return {"processor": load_processor(path / "processor")}


def _encode_wan(pipe, params: Params, device) -> Tensors:
    # As WanPipeline.__call__ (and the image-to-video one) call it: max_sequence_length 512,
    # the negative prompt ("" when none) encoded when guided.
    out = pipe.encode_prompt(
        prompt=params.prompt,
        negative_prompt=params.negative_prompt or None,
        do_classifier_free_guidance=params.guidance_scale > 1,
        num_videos_per_prompt=1,
        max_sequence_length=512,
        device=device,
    )
    return _named(("prompt_embeds", "negative_prompt_embeds"), out)


def _scaled(pipe, latents: torch.Tensor) -> torch.Tensor:
    config = pipe.vae.config
    return latents / config.scaling_factor + (config.shift_factor or 0.0)


def _decode_sd3(pipe, latents: torch.Tensor, params: Params) -> torch.Tensor:
    return pipe.vae.decode(_scaled(pipe, latents.to(pipe.vae.dtype)), return_dict=False)[0]


def _decode_flux(pipe, latents: torch.Tensor, params: Params) -> torch.Tensor:
    unpacked = pipe._unpack_latents(latents, params.height, params.width, pipe.vae_scale_factor)
    return pipe.vae.decode(_scaled(pipe, unpacked), return_dict=False)[0]


def _decode_qwen(pipe, latents: torch.Tensor, params: Params) -> torch.Tensor:
    z = pipe._unpack_latents(latents, params.height, params.width, pipe.vae_scale_factor).to(pipe.vae.dtype)
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(z.device, z.dtype)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(z.device, z.dtype)
    return pipe.vae.decode(z / inverse_std + mean, return_dict=False)[0][:, :, 0]


def _decode_wan(pipe, latents: torch.Tensor, params: Params) -> torch.Tensor:
    """[B, C, frames, h, w] latents -> the VAE's [B, 3, frames, H, W], as WanPipeline ends."""
    z = latents.to(pipe.vae.dtype)
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(z.device, z.dtype)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(z.device, z.dtype)
    return pipe.vae.decode(z / inverse_std + mean, return_dict=False)[0]


def _decode_plain(pipe, latents: torch.Tensor, params: Params) -> torch.Tensor:
    # FLUX.2 hands back latents already unpacked and de-normalised for its VAE.
    return pipe.vae.decode(latents, return_dict=False)[0]


def _decode_flux2(pipe, latents: torch.Tensor, params: Params) -> torch.Tensor:
    """Flux2Pipeline's tail: its latent output is still packed [B, h * w, C] and normalised by
    the VAE's batch norm; the pipeline's own unpacking (by position ids), scaling and unpatching."""
    multiple = pipe.vae_scale_factor * 2
    # The ids depend only on the latent grid's shape, which a tensor on meta gives.
    grid = (latents.shape[0], latents.shape[2], params.height // multiple, params.width // multiple)
    ids = pipe._prepare_latent_ids(torch.empty(grid, device="meta")).to(latents.device)
    z = pipe._unpack_latents_with_ids(latents, ids)
    bn, eps = pipe.vae.bn, pipe.vae.config.batch_norm_eps
    mean = bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(z.device, z.dtype)
    return pipe.vae.decode(pipe._unpatchify_latents(z * std + mean), return_dict=False)[0]


_NO_CFG = "its guidance scale is distilled into the model, which has no unconditional pass"
FLUX = Family(
    name="flux",
    pipeline_class="FluxPipeline",
    encode=_encode_flux,
    decode=_decode_flux,
    embeddings=("prompt_embeds", "pooled_prompt_embeds"),
    img2img_class="FluxImg2ImgPipeline",
    negative_prompt_refusal=_NO_CFG,
    block_attrs=("transformer_blocks", "single_transformer_blocks"),
    packs_2x2=True,
    sequence_parallel=True,
)
SD3 = Family(
    name="sd3",
    pipeline_class="StableDiffusion3Pipeline",
    encode=_encode_sd3,
    decode=_decode_sd3,
    embeddings=("prompt_embeds", "pooled_prompt_embeds"),
    negative_embeddings=("negative_prompt_embeds", "negative_pooled_prompt_embeds"),
    img2img_class="StableDiffusion3Img2ImgPipeline",
    supports_negative_prompt=True,
    block_attrs=("transformer_blocks",),
    cfg_parallel=True,
)
ZIMAGE = Family(
    name="zimage",
    pipeline_class="ZImagePipeline",
    encode=_encode_zimage,
    decode=_decode_sd3,
    embeddings=("prompt_embeds",),
    negative_embeddings=("negative_prompt_embeds",),
    cfg_above=0.0,
    img2img_class="ZImageImg2ImgPipeline",
    supports_negative_prompt=True,
    block_attrs=("noise_refiner", "context_refiner", "layers"),
    packs_2x2=True,
    ragged=True,
)
QWEN_IMAGE = Family(
    name="qwen-image",
    pipeline_class="QwenImagePipeline",
    encode=_encode_qwen,
    decode=_decode_qwen,
    embeddings=("prompt_embeds", "prompt_embeds_mask"),
    optional_embeddings=("negative_prompt_embeds", "negative_prompt_embeds_mask"),
    guidance_keyword="true_cfg_scale",
    img2img_class="QwenImageImg2ImgPipeline",
    supports_negative_prompt=True,
    block_attrs=("transformer_blocks",),
    packs_2x2=True,
)
# Qwen-Image-Edit: Qwen-Image's transformer denoising beside the edit image's latents.
QWEN_IMAGE_EDIT = dataclasses.replace(
    QWEN_IMAGE,
    name="qwen-image-edit",
    pipeline_class="QwenImageEditPipeline",
    encode=_encode_qwen_edit,
    img2img_class=None,
    edit_image=True,
    built_components=_qwen_vl_processor,
)
FLUX2_KLEIN = Family(
    name="flux2-klein",
    pipeline_class="Flux2KleinPipeline",
    encode=_encode_flux2_klein,
    decode=_decode_plain,
    embeddings=("prompt_embeds",),
    optional_embeddings=("negative_prompt_embeds",),  # none when the checkpoint is distilled
    negative_prompt_refusal="Flux2KleinPipeline's unconditional input is always the empty prompt",
    block_attrs=("transformer_blocks", "single_transformer_blocks"),
    packs_2x2=True,
)
FLUX2 = Family(
    name="flux2",
    pipeline_class="Flux2Pipeline",
    encode=_encode_flux2,
    decode=_decode_flux2,
    embeddings=("prompt_embeds",),
    negative_prompt_refusal=_NO_CFG,
    # Its `image` is a reference image conditioning the picture, not a start to noise with a
    # strength: init_image is not served.
    block_attrs=("transformer_blocks", "single_transformer_blocks"),
    packs_2x2=True,
    built_components=_flux2_processor,
)
WAN = Family(
    name="wan",
    pipeline_class="WanPipeline",
    encode=_encode_wan,
    decode=_decode_wan,
    embeddings=("prompt_embeds",),
    negative_embeddings=("negative_prompt_embeds",),
    supports_negative_prompt=True,
    block_attrs=("blocks",),
    video=True,
    experts=("transformer", "transformer_2"),
    # WanPipeline.__call__'s 81 frames, shown at 16 fps as Wan 2.2 A14B's examples export them
    default_num_frames=81,
    default_fps=16,
)
# Wan 2.2's image-to-video: the start image goes to the diffusion stage, whose pipeline encodes it
# with the VAE as the first frame (Wan 2.1's CLIP image encoder is not served).
WAN_I2V = dataclasses.replace(WAN, name="wan-i2v", pipeline_class="WanImageToVideoPipeline", start_image=True)
FAMILIES: dict[str, Family] = {
    f.pipeline_class: f for f in (FLUX, SD3, ZIMAGE, QWEN_IMAGE, QWEN_IMAGE_EDIT, FLUX2_KLEIN, FLUX2, WAN, WAN_I2V)
}
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES.values()}


def family_of(folder: CheckpointFolder) -> Family:
    try:
        return FAMILIES[folder.pipeline_class]
    except KeyError:
        raise FolderError(
            f"checkpoint {folder.path}: pipeline class {folder.pipeline_class!r} is not supported "
            f"(model_index.json's _class_name); supported: {sorted(FAMILIES)}"
        ) from None


def vae_scale_factor(folder: CheckpointFolder) -> int:
    """As the pipelines compute it: 2 ** (number of VAE resolution levels - 1); Qwen-Image's
    VAE lists its downsampling steps instead."""
    config = folder.component_config("vae")
    if "temperal_downsample" in config:
        return 2 ** len(config["temperal_downsample"])
    return 2 ** (len(config["block_out_channels"]) - 1)


# The largest side a diffusers stage takes when its max_size is unset: the families publish sizes
# up to 1664 px (Qwen-Image's 16:9, 1664 x 928; its square 1328), and FLUX.2 draws 4 MP.
LARGEST_SIDE = 2048


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

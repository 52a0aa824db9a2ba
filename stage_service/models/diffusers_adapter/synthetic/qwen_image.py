"""Qwen-Image (QwenImagePipeline): an MMDiT conditioned on the Qwen2.5-VL LLM's hidden states,
with Qwen-Image's own (video-style) VAE."""

from __future__ import annotations

from stagemesh.stage_service.models.diffusers_adapter.loading import import_diffusers
from stagemesh.stage_service.models.diffusers_adapter.synthetic.qwen_text import qwen2_5_vl, qwen_tokenizer

TEXT_DIM = 32
LATENT_CHANNELS = 4
TINY_TRANSFORMER = {
    "patch_size": 2,
    "in_channels": 4 * LATENT_CHANNELS,
    "out_channels": LATENT_CHANNELS,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": TEXT_DIM,
    "axes_dims_rope": (2, 2, 4),
}
# One spatial downsampling: scale factor 2, so a 32x32 image is a 16x16 latent.
TINY_VAE = {
    "base_dim": 8,
    "z_dim": LATENT_CHANNELS,
    "dim_mult": [1, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False],
    "latents_mean": [0.1, -0.2, 0.3, 0.0],
    "latents_std": [1.5, 2.0, 1.2, 0.8],
}


def tiny_components(extra_tokens: tuple[str, ...] = ()) -> dict:
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.qwen_text import VISION_TOKENS

    d = import_diffusers()
    tok = qwen_tokenizer(extra_tokens or VISION_TOKENS)
    return {
        "scheduler": d.FlowMatchEulerDiscreteScheduler(),
        "vae": d.AutoencoderKLQwenImage(**TINY_VAE),
        "text_encoder": qwen2_5_vl(tok, TEXT_DIM, 2),
        "tokenizer": tok,
        "transformer": d.QwenImageTransformer2DModel(**TINY_TRANSFORMER),
    }

"""Wan 2.2 diffusers folders with random weights, built offline from diffusers' and transformers'
own classes: a tiny text-to-video (two experts split at boundary_ratio, as Wan 2.2 A14B) or
image-to-video pipeline for CPU tests. The tokenizer is flux_sd3.t5_tokenizer (UMT5 reads T5's
format); prompts outside its vocabulary map to the unknown token.
"""

from __future__ import annotations

from stagemesh.stage_service.models.diffusers_adapter.loading import import_diffusers
from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux_sd3 import t5_tokenizer

TEXT_DIM = 32
# Wan 2.2 A14B switches from the high-noise expert (transformer) to the low-noise one
# (transformer_2) below this fraction of the training timesteps.
BOUNDARY_RATIO = 0.875
# The tiny transformer: 2 blocks of 2 heads x 12, patches of 1 frame x 2 x 2 latent pixels.
TINY_WAN = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": TEXT_DIM,
    "freq_dim": 32,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}
# Wan's causal 3D VAE at its real strides (4 in time, 8 in space) with few channels.
TINY_WAN_VAE = {
    "base_dim": 3,
    "z_dim": 16,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}


def _umt5(vocab_size: int):
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=TEXT_DIM,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
    )
    return UMT5EncoderModel(config)


def tiny_components(i2v: bool = False, transformer_overrides: dict | None = None) -> dict:
    """WanPipeline components (WanImageToVideoPipeline's with `i2v`: the first frame's latents
    and mask are concatenated to the noise, so the transformer takes 16 + 4 + 16 channels; Wan
    2.2 has no CLIP image encoder)."""
    d = import_diffusers()
    tok = t5_tokenizer()
    config = {**TINY_WAN, **(transformer_overrides or {})}
    if i2v:
        config["in_channels"] = 36
    components = {
        "tokenizer": tok,
        "text_encoder": _umt5(len(tok)),
        "vae": d.AutoencoderKLWan(**TINY_WAN_VAE),
        "scheduler": d.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        "transformer": d.WanTransformer3DModel(**config),
        "transformer_2": d.WanTransformer3DModel(**config),
        "boundary_ratio": BOUNDARY_RATIO,
    }
    if i2v:
        components.update(image_encoder=None, image_processor=None)
    return components


def tiny_i2v_components() -> dict:
    return tiny_components(i2v=True)

"""FLUX.2 [klein] (Flux2KleinPipeline): FLUX.2's transformer over a Qwen3 causal LM, whose
hidden states at layers 9, 18 and 27 are stacked (so the tiny LM keeps 27 layers, narrow)."""

from __future__ import annotations

from stagemesh.stage_service.models.diffusers_adapter.loading import import_diffusers
from stagemesh.stage_service.models.diffusers_adapter.synthetic.qwen_text import qwen3, qwen_tokenizer

TEXT_DIM = 16
TEXT_LAYERS = 27  # the pipeline reads hidden states 9, 18 and 27
TINY_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 3 * TEXT_DIM,
    "timestep_guidance_channels": 16,
    "axes_dims_rope": (2, 2, 2, 2),
    "guidance_embeds": False,
}
TINY_VAE = {
    "block_out_channels": (4, 8),
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "layers_per_block": 1,
    "latent_channels": 4,
    "norm_num_groups": 1,
    "sample_size": 32,
}


def tiny_components() -> dict:
    d = import_diffusers()
    tok = qwen_tokenizer()
    return {
        "scheduler": d.FlowMatchEulerDiscreteScheduler(),
        "vae": d.AutoencoderKLFlux2(**TINY_VAE),
        "text_encoder": qwen3(tok, TEXT_DIM, TEXT_LAYERS, causal_lm=True),
        "tokenizer": tok,
        "transformer": d.Flux2Transformer2DModel(**TINY_TRANSFORMER),
        "is_distilled": False,  # guided: the unconditional pass runs above guidance 1
    }

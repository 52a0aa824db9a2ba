"""Z-Image (ZImagePipeline): a single-stream DiT over a Qwen3 text encoder, FLUX.1's VAE layout."""

from __future__ import annotations

from stagemesh.stage_service.models.diffusers_adapter.loading import import_diffusers
from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux_sd3 import TINY_VAE
from stagemesh.stage_service.models.diffusers_adapter.synthetic.qwen_text import qwen3, qwen_tokenizer

TEXT_DIM = 32
TINY_TRANSFORMER = {
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 4,
    "dim": 32,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "cap_feat_dim": TEXT_DIM,
    "axes_dims": [4, 6, 6],
    "axes_lens": [256, 64, 64],
}


def tiny_components() -> dict:
    d = import_diffusers()
    tok = qwen_tokenizer()
    return {
        "scheduler": d.FlowMatchEulerDiscreteScheduler(),
        "vae": d.AutoencoderKL(**{**TINY_VAE, "latent_channels": 4}),
        "text_encoder": qwen3(tok, TEXT_DIM, 2),
        "tokenizer": tok,
        "transformer": d.ZImageTransformer2DModel(**TINY_TRANSFORMER),
    }

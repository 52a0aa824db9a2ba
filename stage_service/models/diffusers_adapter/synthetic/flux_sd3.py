"""FLUX.1 and SD3 components with random weights (tiny for CPU tests; bench/real_pipeline.py
builds a FLUX-size transformer with them), and the CLIP and T5 tokenizers they share, made from
small vocabularies written here (no download); prompts outside them map to the unknown token.
"""

from __future__ import annotations

import string

from stagemesh.stage_service.models.diffusers_adapter.loading import import_diffusers

CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512
# The FLUX-style tiny transformer: 1 double-stream and 2 single-stream blocks, head dim 16.
TINY_FLUX = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "axes_dims_rope": (4, 4, 8),
}
TINY_SD3 = {
    "sample_size": 32,
    "patch_size": 1,
    "in_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 4,
    "caption_projection_dim": 32,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "out_channels": 4,
}
# A two-level VAE: scale factor 2, so a 32x32 image is a 16x16 latent.
TINY_VAE = {
    "sample_size": 32,
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": (4, 8),
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "layers_per_block": 1,
    "norm_num_groups": 1,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "shift_factor": 0.0609,
    "scaling_factor": 1.5035,
}
# FLUX.1's own VAE layout (16 latent channels, scale factor 8).
FLUX_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 2,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "shift_factor": 0.1159,
    "scaling_factor": 0.3611,
}


def clip_tokenizer():
    """Characters and word-final characters, no merges: every prompt tokenizes."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase + string.digits:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def t5_tokenizer():
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_lowercase + string.digits]
    pieces += [("\u2581" + c, -2.5) for c in string.ascii_lowercase]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


def _clip(hidden: int, with_projection: bool, vocab_size: int):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=2,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        projection_dim=hidden,
        max_position_embeddings=CLIP_MAX_LENGTH,
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(config)


def _t5(d_model: int, vocab_size: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=d_model,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=2,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def flux_components(transformer=None, vae_config: dict | None = None, text_dim: int = 32, pooled_dim: int = 32) -> dict:
    """FluxPipeline components; `transformer` defaults to the tiny one (random init)."""
    d = import_diffusers()
    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    return {
        "scheduler": d.FlowMatchEulerDiscreteScheduler(),
        "vae": d.AutoencoderKL(**(vae_config or {**TINY_VAE, "latent_channels": 4})),
        "text_encoder": _clip(pooled_dim, False, len(tok)),
        "tokenizer": tok,
        "text_encoder_2": _t5(text_dim, len(tok2)),
        "tokenizer_2": tok2,
        "transformer": transformer if transformer is not None else d.FluxTransformer2DModel(**TINY_FLUX),
    }


def sd3_components() -> dict:
    d = import_diffusers()
    tok, tok2, tok3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    # The two CLIP encoders' hidden states are concatenated (16 + 16) and padded to T5's 32.
    return {
        "scheduler": d.FlowMatchEulerDiscreteScheduler(shift=3.0),
        "vae": d.AutoencoderKL(**{**TINY_VAE, "latent_channels": 4}),
        "text_encoder": _clip(16, True, len(tok)),
        "tokenizer": tok,
        "text_encoder_2": _clip(16, True, len(tok2)),
        "tokenizer_2": tok2,
        "text_encoder_3": _t5(32, len(tok3)),
        "tokenizer_3": tok3,
        "transformer": d.SD3Transformer2DModel(**TINY_SD3),
    }

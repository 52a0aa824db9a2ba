"""Random-weight folders at the published dimensions of each family, for smoke tests of a
deployment and for benchmarks, without a download.

Nothing is materialised as a whole: every model component is built on the meta device (its
buffers and rotary tables computed, they are small), then its tensors are drawn one at a time in
the target dtype and written to safetensors shards of at most SHARD_BYTES. The tokenizers and the
scheduler are the tiny folder's (tokenizers built offline, so the text encoders' vocabularies are
theirs, a few hundred entries; every other dimension is the published one). `text_layers`
shortens the text encoders (their width, which the transformer's input follows, stays): a
benchmark times the transformer.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stagemesh.stage_service.models.diffusers_adapter.loading import import_diffusers

SHARD_BYTES = 2 << 30  # what one shard holds in host memory while it is written
_DIFFUSERS_WEIGHTS = "diffusion_pytorch_model"
_TRANSFORMERS_WEIGHTS = "model"


def _empty(build: Callable[[], nn.Module]) -> nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        module = build()
    tie = getattr(module, "tie_weights", None)
    if callable(tie):  # a transformers model ties its embedding and head as its config says
        tie()
    return module


def _fill(name: str, meta: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A plausible random value: norms' scales 1, biases and running means 0, running variances
    1, matrices N(0, 0.02) (so activations stay in range through deep stacks)."""
    leaf = name.rsplit(".", 1)[-1]
    target = dtype if meta.is_floating_point() else meta.dtype
    if not meta.is_floating_point() or leaf in ("bias", "running_mean"):
        return torch.zeros(meta.shape, dtype=target)
    if leaf == "running_var" or (meta.dim() == 1 and leaf in ("weight", "scale", "gamma")):
        return torch.ones(meta.shape, dtype=target)
    # Drawn where the generator lives (a GPU draws a 20 B model in seconds), written from the host.
    drawn = torch.randn(meta.shape, generator=generator, device=generator.device)
    return (drawn * 0.02).to(target).cpu()


def write_random(
    module: nn.Module,
    where: Path,
    stem: str,
    dtype: torch.dtype,
    seed: int,
    shard_bytes: int | None = None,
    device: str = "cpu",
) -> int:
    """Write `module`'s state (shapes only are read) as random safetensors shards under `where`
    in `dtype`; returns the bytes written. Tensors tied together (an embedding shared with
    another) get one value, written under each name."""
    from safetensors.torch import save_file

    params = module.state_dict(keep_vars=True)
    state = {key: t.detach() for key, t in params.items()}
    owner = {key: id(t) for key, t in params.items()}
    tied = {i for i, n in Counter(owner.values()).items() if n > 1}
    drawn_tied: dict[int, torch.Tensor] = {}
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * (itemsize if t.is_floating_point() else t.element_size())
        if shards[-1] and size + nbytes > (shard_bytes or SHARD_BYTES):
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    generator = torch.Generator(device).manual_seed(seed)
    names = (
        [f"{stem}.safetensors"]
        if len(shards) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    total = 0
    weight_map = {}
    for keys, file in zip(shards, names):
        tensors = {}
        for key in keys:
            if owner[key] in tied:
                if owner[key] not in drawn_tied:
                    drawn_tied[owner[key]] = _fill(key, state[key], dtype, generator)
                tensors[key] = drawn_tied[owner[key]].clone()  # safetensors stores no shared memory
            else:
                tensors[key] = _fill(key, state[key], dtype, generator)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(where / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (where / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def _replace(folder: Path, name: str, module: nn.Module, dtype: torch.dtype, seed: int, device: str) -> int:
    """Put `module` (on meta) in place of the tiny folder's component `name`."""
    where = folder / name
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    model: Any = module
    if hasattr(model, "save_config"):  # a diffusers model
        model.save_config(where)
        stem = _DIFFUSERS_WEIGHTS
    else:
        model.config.save_pretrained(where)
        stem = _TRANSFORMERS_WEIGHTS
    return write_random(module, where, stem, dtype, seed, device=device)


# ---- the published dimensions -----------------------------------------------------------------
def _qwen3(tok, layers: int, causal_lm: bool):
    """Qwen3-4B's dimensions (Z-Image's and FLUX.2 [klein] 4B's text encoder)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config)


def _qwen2_5_vl_7b(tok, layers: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {
        "vocab_size": len(tok),
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": layers,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
    }
    vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584}
    ids = {
        "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>"),
        "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
    }
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))


def _mistral3_small(tok, layers: int):
    """Mistral Small 3.1 24B with its Pixtral vision tower (FLUX.2 [dev]'s text encoder)."""
    from transformers import Mistral3ForConditionalGeneration

    from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux2_dev import mistral3_config

    text = {
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e9},
        "sliding_window": None,
    }
    vision = {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "head_dim": 64,
        "patch_size": 14,
        "image_size": 1540,
    }
    return Mistral3ForConditionalGeneration(mistral3_config(tok, text, vision))


def _clip(vocab: int, hidden: int, layers: int, heads: int, projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        projection_dim=hidden,
        max_position_embeddings=77,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5_xxl(vocab: int, layers: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab,
        d_model=4096,
        d_kv=64,
        d_ff=10240,
        num_layers=layers,
        num_heads=64,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config)


def _flux_vae(d, shift: float, scale: float):
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.flux_sd3 import FLUX_VAE

    return d.AutoencoderKL(**{**FLUX_VAE, "shift_factor": shift, "scaling_factor": scale})


# The families written at their published dimensions (the video families: tiny folders only).
FULL_SIZE_FAMILIES = ("flux", "sd3", "zimage", "qwen-image", "qwen-image-edit", "flux2-klein", "flux2")


def full_components(family: str, folder: Path, text_layers: int | None) -> dict[str, Callable[[], nn.Module]]:
    """Component name -> a builder of the published-size module (called on meta). The tiny
    folder at `folder` supplies the tokenizers the text encoders' vocabularies follow."""
    d = import_diffusers()
    transformers = __import__("transformers")

    def tokenizer(name: str = "tokenizer"):
        return transformers.AutoTokenizer.from_pretrained(folder / name, local_files_only=True)

    def depth(published: int, least: int = 1) -> int:
        return published if text_layers is None else max(least, min(text_layers, published))

    if family == "zimage":  # Z-Image-Turbo (6 B): the transformer's defaults are its dimensions
        return {
            "transformer": lambda: d.ZImageTransformer2DModel(),
            "vae": lambda: _flux_vae(d, 0.1159, 0.3611),
            "text_encoder": lambda: _qwen3(tokenizer(), depth(36), causal_lm=False),
        }
    if family in ("qwen-image", "qwen-image-edit"):  # Qwen-Image(-Edit) (20 B) and its Qwen2.5-VL-7B
        return {
            "transformer": lambda: d.QwenImageTransformer2DModel(),
            "vae": lambda: d.AutoencoderKLQwenImage(),
            "text_encoder": lambda: _qwen2_5_vl_7b(tokenizer(), depth(28)),
        }
    if family == "flux2-klein":  # FLUX.2 [klein] 4B; its text encoder's layers 9, 18, 27 are read
        return {
            "transformer": lambda: d.Flux2Transformer2DModel(
                in_channels=128,
                num_layers=5,
                num_single_layers=20,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=3 * 2560,
                guidance_embeds=False,
            ),
            "vae": lambda: d.AutoencoderKLFlux2(),
            "text_encoder": lambda: _qwen3(tokenizer(), depth(36, least=28), causal_lm=True),
        }
    if family == "flux2":  # FLUX.2 [dev] (32 B: the transformer's defaults); layers 10, 20, 30 are read
        return {
            "transformer": lambda: d.Flux2Transformer2DModel(),
            "vae": lambda: d.AutoencoderKLFlux2(),
            "text_encoder": lambda: _mistral3_small(tokenizer(), depth(40, least=31)),
        }
    if family == "flux":  # FLUX.1-dev (12 B)
        return {
            "transformer": lambda: d.FluxTransformer2DModel(guidance_embeds=True),
            "vae": lambda: _flux_vae(d, 0.1159, 0.3611),
            "text_encoder": lambda: _clip(len(tokenizer()), 768, depth(12), 12, projection=False),
            "text_encoder_2": lambda: _t5_xxl(len(tokenizer("tokenizer_2")), depth(24)),
        }
    if family == "sd3":  # Stable Diffusion 3 medium (2 B)
        return {
            "transformer": lambda: d.SD3Transformer2DModel(
                sample_size=128,
                num_layers=24,
                attention_head_dim=64,
                num_attention_heads=24,
                caption_projection_dim=1536,
                pooled_projection_dim=2048,
                joint_attention_dim=4096,
                pos_embed_max_size=192,
            ),
            "vae": lambda: _flux_vae(d, 0.0609, 1.5305),
            "text_encoder": lambda: _clip(len(tokenizer()), 768, depth(12), 12, projection=True),
            "text_encoder_2": lambda: _clip(len(tokenizer("tokenizer_2")), 1280, depth(32), 20, projection=True),
            "text_encoder_3": lambda: _t5_xxl(len(tokenizer("tokenizer_3")), depth(24)),
        }
    raise ValueError(f"no published dimensions for family {family!r}")


def _set_pixels(config_file: Path, pixels: dict) -> None:
    config = json.loads(config_file.read_text())
    config["size"] = {"shortest_edge": pixels["min_pixels"], "longest_edge": pixels["max_pixels"]}
    config_file.write_text(json.dumps(config, indent=2))


def write_full(
    path: str | Path,
    family: str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    text_layers: int | None = None,
    report: Callable[[str], None] = lambda line: None,
    device: str = "cpu",
) -> Path:
    """A folder of `family` at its published dimensions with random weights in `dtype`, drawn
    on `device`."""
    from stagemesh.stage_service.models.diffusers_adapter.synthetic.tiny import write_tiny

    folder = write_tiny(path, family, seed)
    if family == "flux2-klein":  # the published klein 4B is the distilled one
        index = json.loads((folder / "model_index.json").read_text())
        index["is_distilled"] = True
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    if family == "qwen-image-edit":  # the published processor's image bounds, not the tiny ones
        from stagemesh.stage_service.models.diffusers_adapter.synthetic.qwen_image_edit import PUBLISHED_PIXELS

        _set_pixels(folder / "processor" / "preprocessor_config.json", PUBLISHED_PIXELS)
    for i, (name, build) in enumerate(full_components(family, folder, text_layers).items()):
        module = _empty(build)
        written = _replace(folder, name, module, dtype, seed + 1 + i, device)
        report(f"{name}: {type(module).__name__}, {written / 2**30:.2f} GiB")
    return folder

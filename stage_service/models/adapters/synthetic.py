"""Random-weight LoRA adapters for a transformer's layers, in diffusers' own file layout
(`transformer.<layer>.lora_A.weight` / `lora_B.weight`, as `save_lora_weights` writes): what the
tests and benchmarks load. Only the layers' shapes are read, so a transformer built on "meta"
(a FLUX-sized one) will do."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

# The attention projections of FLUX's and SD3's blocks (diffusers' names).
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def target_layers(transformer: nn.Module, targets: tuple[str, ...] = ATTENTION_TARGETS) -> list[tuple[str, nn.Linear]]:
    return [
        (name, module)
        for name, module in transformer.named_modules()
        if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    ]


def random_lora(
    transformer: nn.Module,
    rank: int = 4,
    seed: int = 0,
    targets: tuple[str, ...] = ATTENTION_TARGETS,
    dtype: torch.dtype = torch.float32,
    strength: float = 0.5,
) -> dict[str, torch.Tensor]:
    """A LoRA state dict for every target Linear: A ~ N(0, 1/in), B ~ N(0, strength^2 / rank)."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, layer in target_layers(transformer, targets):
        a = torch.randn(rank, layer.in_features, generator=generator) / layer.in_features**0.5
        b = torch.randn(layer.out_features, rank, generator=generator) * (strength / rank**0.5)
        state[f"transformer.{name}.lora_A.weight"] = a.to(dtype)
        state[f"transformer.{name}.lora_B.weight"] = b.to(dtype)
    if not state:
        raise ValueError(f"the transformer has no Linear layer named like {targets}")
    return state


def write_random_lora(path: str | Path, transformer: nn.Module, **kwargs) -> Path:
    """`random_lora(transformer, **kwargs)` saved as one safetensors file at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(random_lora(transformer, **kwargs), str(path))
    return path

"""Adapter files: where a stage finds them (its lora_dir) and how one becomes the transformer's
state dict, checked against the model's layer names before anything is added to it."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stagemesh.core.params import ADAPTER_NAME_PATTERN

SUFFIX = ".safetensors"
# Where a LoRA layer's own tensors begin in a converted key ("<layer>.lora_A.weight", ...).
_LORA_PART = re.compile(r"\.lora_(?:A|B|down|up|magnitude_vector|embedding_A|embedding_B)\b")
TRANSFORMER_PREFIX = "transformer."


class AdapterFileError(ValueError):
    """A file that cannot be an adapter of this model; the message names why."""


def discover(lora_dir: str | Path) -> dict[str, Path]:
    """Adapters of a lora_dir: each `NAME.safetensors` file and each folder NAME holding one
    (diffusers' `save_lora_weights` layout), by NAME; names that are not adapter names are skipped."""
    root = Path(lora_dir)
    if not root.is_dir():
        raise AdapterFileError(f"lora_dir {root} is not a folder")
    found: dict[str, Path] = {}
    for entry in sorted(root.iterdir()):
        name = entry.name[: -len(SUFFIX)] if entry.is_file() and entry.name.endswith(SUFFIX) else entry.name
        if entry.is_file() and not entry.name.endswith(SUFFIX):
            continue
        if entry.is_dir() and not any(entry.glob(f"*{SUFFIX}")):
            continue
        if re.fullmatch(ADAPTER_NAME_PATTERN, name):
            found[name] = entry
    return found


def resolve_source(lora_dir: str | Path, path: str) -> Path:
    """`path` (relative to lora_dir, or absolute inside it) as an existing file or folder; a path
    that leaves lora_dir is refused, so a control call reads only what the operator put there."""
    if not lora_dir:
        raise AdapterFileError("this stage has no lora_dir; set the stage option lora_dir to load adapters")
    root = Path(lora_dir).resolve()
    target = (root / path).resolve()
    if target != root and root not in target.parents:
        raise AdapterFileError(f"path {path!r} is outside the stage's lora_dir {root}; allowed: paths inside it")
    if not target.exists():
        raise AdapterFileError(f"path {path!r}: no such file or folder in lora_dir {root}")
    return target


@dataclass(frozen=True)
class AdapterWeights:
    """What `load_lora_adapter` takes: the converted state dict and its side information."""

    state_dict: dict[str, torch.Tensor]
    network_alphas: Any
    metadata: Any


def read(pipe, source: Path) -> AdapterWeights:
    """The file through the pipeline's own `lora_state_dict`, which also converts the community
    formats `load_lora_weights` reads (kohya, xlabs, ...) into diffusers' names."""
    kwargs: dict[str, Any] = {"return_lora_metadata": True}
    takes_alphas = "return_alphas" in inspect.signature(pipe.lora_state_dict).parameters
    if takes_alphas:
        kwargs["return_alphas"] = True
    try:
        out = pipe.lora_state_dict(str(source), **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise AdapterFileError(f"{source.name}: not an adapter file diffusers can read ({exc})") from None
    state, alphas, metadata = out if takes_alphas else (out[0], None, out[1])
    return AdapterWeights(state, alphas, metadata)


def check_layers(transformer: nn.Module, weights: AdapterWeights) -> int:
    """The number of transformer layers the adapter adapts; refuses a file holding other
    components' layers or naming a layer the model lacks (the first such one, by its name)."""
    layers: list[str] = []
    for key in weights.state_dict:
        if not key.startswith(TRANSFORMER_PREFIX):
            raise AdapterFileError(
                f"holds {key!r}, which is not the transformer's; only transformer adapters are served "
                "(text-encoder layers would change the encoder stage)"
            )
        found = _LORA_PART.search(key)
        if found is None:
            raise AdapterFileError(f"holds {key!r}, which is no LoRA weight (lora_A / lora_B)")
        layer = key[len(TRANSFORMER_PREFIX) : found.start()]
        if layer not in layers:
            layers.append(layer)
    if not layers:
        raise AdapterFileError("holds no transformer LoRA weights")
    modules = dict(transformer.named_modules())
    for layer in layers:
        if layer not in modules:
            raise AdapterFileError(f"does not match this model: it adapts layer {layer!r}, which the transformer lacks")
    return len(layers)

"""Where a model's tensors live under layerwise offload: the streamed blocks' tensors belong to
their blocks alone (a tensor tied across blocks, or between a block and the rest of the model,
cannot be streamed: its one storage would have to be in two slots or on the host and the device
at once), and everything outside the streamed blocks moves to the device.
"""

from __future__ import annotations

import torch
from torch import nn

from stagemesh.stage_service.offload.layout import BlockLayout


def _inside(name: str, roots: set[str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:k]) in roots for k in range(1, len(parts) + 1))


def check_no_sharing(model: nn.Module, layouts: list[BlockLayout], roots: set[str]) -> None:
    """ValueError naming both owners when a streamed block shares a tensor with another block or
    with a module outside the streamed blocks (`roots`: their paths)."""
    owner: dict[int, str] = {}
    for layout in layouts:
        for key in layout.tensor_ids():
            if key in owner:
                raise ValueError(
                    f"blocks {owner[key]!r} and {layout.path!r} share a tensor; "
                    "tied weights across blocks cannot be streamed"
                )
            owner[key] = layout.path
    for name, module in model.named_modules(remove_duplicate=False):
        if _inside(name, roots):
            continue
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None and id(t) in owner:
                raise ValueError(
                    f"{name or type(model).__name__} shares a tensor with streamed "
                    f"block {owner[id(t)]!r}; tied weights cannot be streamed"
                )


def move_rest(model: nn.Module, roots: set[str], device: torch.device) -> None:
    """Everything outside the streamed blocks goes to the device, Parameter objects kept."""
    for name, module in model.named_modules():
        if _inside(name, roots):
            continue
        for p in module._parameters.values():
            if p is not None and p.device != device:
                p.data = p.data.to(device)
        for key, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[key] = b.to(device)

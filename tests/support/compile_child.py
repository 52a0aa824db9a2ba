"""A process that compiles a small embedded DiT's blocks the way a stage does (regional compile,
the inductor cache under ROOT/compile/<key>), runs it once and prints its compile counters as JSON:
what a restarted stage does, in a process of its own (torch's in-memory caches die with it).

Usage: python -m tests.support.compile_child ROOT [DTYPE]"""

from __future__ import annotations

import json
import sys

import torch

from stagemesh.stage_service.models.acceleration import compile as regional
from stagemesh.stage_service.models.config import DiTConfig
from stagemesh.stage_service.models.dit import DiT

CFG = DiTConfig(hidden_size=32, depth=2, num_heads=2, cond_dim=16, decoder_channels=8)


def tiny_dit(dtype: torch.dtype = torch.float32) -> DiT:
    torch.manual_seed(0)
    return DiT(CFG).to(dtype).eval().requires_grad_(False)


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 4, 8, 8, generator=g), torch.rand(1, generator=g), torch.randn(1, 5, 16, generator=g)


def main() -> None:
    root = sys.argv[1]
    dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
    torch.set_num_threads(1)
    model = tiny_dit(dtype)
    material = regional.key_material(model, "cpu", {"compile": "regional", "fullgraph": True})
    path = regional.use_cache_dir(root, material)
    regional.compile_blocks(model)
    with torch.inference_mode():
        model(*inputs())
    print(json.dumps({"cache_dir": str(path), **regional.compile_counters()}))


if __name__ == "__main__":
    main()

"""A small embedded DiT with random bf16 weights and a fixed run of it on CUDA: the model the
GPU tests of layerwise offload compare streamed and resident forwards on."""

from __future__ import annotations

import torch

from stagemesh.stage_service.models.config import DiTConfig
from stagemesh.stage_service.models.dit import DiT

CFG = DiTConfig(hidden_size=256, num_heads=4, cond_dim=64, decoder_channels=8)


def small_dit(depth: int) -> DiT:
    """The same weights for the same depth on every call (never zeros)."""
    torch.manual_seed(0)
    model = DiT(DiTConfig(**{**CFG.__dict__, "depth": depth}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def run_on_cuda(model: DiT, iterations: int = 4) -> list[torch.Tensor]:
    """`iterations` forwards of fixed random inputs on CUDA, outputs back on the host in float32."""
    out = []
    with torch.inference_mode():
        for k in range(iterations):
            g = torch.Generator().manual_seed(k)
            x, t = torch.randn(2, 4, 32, 32, generator=g), torch.rand(2, generator=g)
            c = torch.randn(2, 77, 64, generator=g)
            out.append(model(x.cuda(), t.cuda(), c.cuda()).float().cpu())
    torch.cuda.synchronize()
    return out

"""Sequence- and CFG-parallel DiT on two (and four) GPUs over NCCL (skipped with fewer): the
guided velocity of a bf16 DiT split by sequence (Ulysses, and ring with 3 heads on 2 ranks) and
by guidance pass equals one GPU's within bf16 tolerance, and every rank holds the same result."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from stagemesh.core.procutil import free_port
from stagemesh.stage_service.models.config import DiTConfig
from stagemesh.stage_service.models.dit import DiT, pad_conds, velocity
from stagemesh.stage_service.models.parallel import ImageParallel, form_axes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

BF16 = {"rtol": 2e-2, "atol": 2e-2}  # bf16: 8 mantissa bits, rounded in a different order
# (heads, sp_size, cfg passes): Ulysses, ring (3 heads on 2 ranks), CFG, both (4 GPUs)
SPLITS = [(4, 2, 1), (3, 2, 1), (4, 1, 2), (4, 2, 2)]


def _dit(heads: int, device: torch.device) -> DiT:
    torch.manual_seed(0)  # the same weights on every rank
    model = DiT(DiTConfig(hidden_size=96, num_heads=heads, cond_dim=64, depth=3))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.to(device, torch.bfloat16).eval().requires_grad_(False)


def _velocities(dit: DiT, device: torch.device, parallel: ImageParallel | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cond, mask = pad_conds([torch.randn(77, 64, generator=g).to(torch.bfloat16), dit.null_cond.cpu()], 128)
    cond, mask = cond.to(device), mask.to(device)
    if parallel is not None and parallel.cfg.split:
        cond, mask = cond[parallel.cfg.rank : parallel.cfg.rank + 1], mask[parallel.cfg.rank : parallel.cfg.rank + 1]
    out = []
    with torch.inference_mode():
        for side in (64, 62):  # 1024 image tokens, and 961 (padded)
            x = torch.randn(1, 4, side, side, generator=g).to(device)
            t = torch.full((cond.shape[0],), 0.6, device=device)
            cfg = None if parallel is None else parallel.cfg
            out.append(velocity(dit, x, t, cond, mask, True, 4.0, cfg).float().cpu())
    return out


def _rank_main(rank: int, world: int, port: int, split: tuple, out_dir: str) -> None:
    from stagemesh.stage_service.offload.collective import join_group, leave_group

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    device = torch.device("cuda", rank)
    join_group(f"tcp://127.0.0.1:{port}", rank, world, str(device), 120)
    try:
        heads, sp, cfg = split
        parallel = form_axes(sp, cfg, rank)
        dit = _dit(heads, device)
        dit.sequence_parallel = parallel.sp
        torch.save(_velocities(dit, device, parallel), Path(out_dir, f"rank{rank}.pt"))
    finally:
        leave_group()


@pytest.mark.parametrize("split", SPLITS, ids=["ulysses", "ring", "cfg", "sp-x-cfg"])
def test_split_velocity_equals_one_gpu(split, tmp_path):
    heads, sp, cfg = split
    world = sp * cfg
    if world > torch.cuda.device_count():
        pytest.skip(f"needs {world} CUDA devices")
    device = torch.device("cuda", 0)
    want = _velocities(_dit(heads, device), device)
    mp.spawn(_rank_main, args=(world, free_port(), split, str(tmp_path)), nprocs=world, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for g, w in zip(got[0], want):
        torch.testing.assert_close(g, w, **BF16)
    for other in got[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, got[0]))

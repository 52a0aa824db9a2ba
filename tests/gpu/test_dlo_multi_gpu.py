"""DLO AllGather across two or more GPUs over NCCL (skipped with fewer): the engine on its own,
and a `stagemesh up` mesh whose diffusion stage runs DP waves on cuda:0 and cuda:1."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stagemesh.core.procutil import free_port
from stagemesh.stage_service.models.config import DiTConfig
from stagemesh.stage_service.models.dit import DiT
from stagemesh.stage_service.offload import LayerwiseOffload
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import start_mesh, write_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mesh,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

# depth 5: an odd block count; hidden 264 makes blocks whose bytes 2 does not split into
# aligned halves, so the shard remainder path runs.
CFG = DiTConfig(hidden_size=264, num_heads=4, cond_dim=64, decoder_channels=8, depth=5)


def _model() -> DiT:
    torch.manual_seed(0)  # every rank builds the same weights
    model = DiT(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def _outputs(model: DiT, device: torch.device) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for k in range(3):  # repeated iterations: the slots wrap around
            g = torch.Generator().manual_seed(k)
            x, t = torch.randn(2, 4, 32, 32, generator=g), torch.rand(2, generator=g)
            c = torch.randn(2, 77, 64, generator=g)
            out.append(model(x.to(device), t.to(device), c.to(device)).float().cpu())
    torch.cuda.synchronize(device)
    return out


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device
    )
    try:
        resident = _model()
        want = _outputs(copy.deepcopy(resident).to(device), device)
        gathered = copy.deepcopy(resident)
        engine = LayerwiseOffload(gathered, device, group=dist.group.WORLD)
        got = _outputs(gathered, device)
        plain = copy.deepcopy(resident)
        LayerwiseOffload(plain, device, use_allgather=False)
        streamed = _outputs(plain, device)
        stats = engine.stats()
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "equal_no_allgather": all(torch.equal(a, b) for a, b in zip(got, streamed)),
                    "max_diff_resident": max(float((a - b).abs().max()) for a, b in zip(got, want)),
                    "scale": max(float(b.abs().max()) for b in want),
                    "mode": stats.host_mode,
                    "world": stats.world,
                    "h2d": stats.h2d_bytes_per_iteration,
                    "block_bytes": stats.block_bytes,
                }
            )
        )
    finally:
        dist.destroy_process_group()


def test_allgather_over_nccl_equals_no_allgather_and_resident(tmp_path: Path):
    world = torch.cuda.device_count()
    mp.spawn(_rank_main, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["mode"] == "sharded" and r["world"] == world
        assert r["equal_no_allgather"], f"rank {rank}: AllGather differs from no-AllGather"
        # bf16 weights: the same kernels on the same numbers; allow bf16 rounding only.
        assert r["max_diff_resident"] <= 1e-2 * max(1.0, r["scale"]), r
        # Each rank moves ~1/world of the bytes over its host link.
        assert r["h2d"] <= r["block_bytes"] / world + 4096 * CFG.depth


def _pngs(m, params, concurrent: bool) -> list[bytes]:
    with m.channel() as channel:
        stub = m.gateway(channel)

        def one(p):
            return stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=p), timeout=300).result.png

        if not concurrent:
            return [one(p) for p in params]
        with cf.ThreadPoolExecutor(len(params)) as pool:
            return list(pool.map(one, params))


def test_mesh_dp_waves_on_two_gpus_draw_what_one_gpu_draws(tmp_path: Path, model_dir):
    params = [
        generation_pb2.GenerationParams(
            prompt=f"a lighthouse {k}", width=128, height=128, num_inference_steps=4, seed=k
        )
        for k in range(4)
    ]
    got = {}
    for name, extra in (
        ("one GPU", 'device = "cuda:0"\nenable_dlo = true\n'),
        ("dp waves", 'device = "cuda"\nenable_dlo = true\ndp_size = 2\n'),
    ):
        config = write_config(tmp_path / f"{name}.toml".replace(" ", "-"), model_dir)
        # The diffusion stage is the file's last table: these keys land on it.
        config.write_text(config.read_text() + extra)
        m = start_mesh(config, tmp_path / f"{name}.log".replace(" ", "-"))
        try:
            got[name] = _pngs(m, params, concurrent=name == "dp waves")
            assert '"dp group' not in m.logs()  # no wave failed on the way
        finally:
            assert m.stop() == 0, m.logs()[-3000:]
    assert len(set(got["dp waves"])) == len(params)
    assert got["dp waves"] == got["one GPU"]

"""DLO AllGather across real gloo process groups (2 and 3 ranks) on the CPU."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stagemesh.core.procutil import free_port
from stagemesh.stage_service.models.config import DiTConfig
from stagemesh.stage_service.models.dit import DiT
from stagemesh.stage_service.offload import LayerwiseOffload, collective
from stagemesh.stage_service.offload.host import shard_nbytes
from stagemesh.stage_service.offload.layout import ALIGN

# hidden 36: a block whose byte size 3 does not divide (asserted below).
CFG = DiTConfig(hidden_size=36, num_heads=3, cond_dim=12, decoder_channels=8, depth=5)


def _model() -> DiT:
    torch.manual_seed(0)  # every rank builds the same weights
    model = DiT(CFG).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _outputs(model: DiT) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for k in range(3):
            g = torch.Generator().manual_seed(k)
            out.append(
                model(
                    torch.randn(2, 4, 8, 8, generator=g), torch.rand(2, generator=g), torch.randn(2, 5, 12, generator=g)
                )
            )
    return out


def _check(rank: int, world: int, list_only: bool) -> dict:
    if list_only:
        collective._LIST_ONLY.add("gloo")
    resident = _model()
    want = _outputs(copy.deepcopy(resident))
    sharded = copy.deepcopy(resident)
    engine = LayerwiseOffload(sharded, "cpu", group=dist.group.WORLD)
    got = _outputs(sharded)
    local = copy.deepcopy(resident)
    LayerwiseOffload(local, "cpu", group=dist.group.WORLD, use_allgather=False)
    plain = _outputs(local)
    stats = engine.stats()
    block = engine.layouts[0].nbytes
    return {
        "equal_resident": all(torch.equal(a, b) for a, b in zip(got, want)),
        "equal_no_allgather": all(torch.equal(a, b) for a, b in zip(got, plain)),
        "world": stats.world,
        "mode": stats.host_mode,
        "host_bytes": stats.host_bytes,
        "block_bytes": stats.block_bytes,
        "block": block,
        "expected_host": sum(shard_nbytes(lay.nbytes, world) for lay in engine.layouts),
    }


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {"single": _check(rank, world, False), "list": _check(rank, world, True)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_allgather_equals_resident_and_no_allgather(world: int, tmp_path: Path):
    mp.spawn(_rank_main, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for path, r in result.items():
            assert r["equal_resident"] and r["equal_no_allgather"], (rank, path)
            assert r["world"] == world and r["mode"] == "sharded"
            # Each rank keeps ~1/world of the weights: its shards, padded to equal size.
            assert r["host_bytes"] == r["expected_host"]
            assert r["host_bytes"] <= r["block_bytes"] / world + ALIGN * CFG.depth
    assert world != 3 or result["single"]["block"] % 3, "want a block that 3 does not divide"


def test_group_of_one_runs_no_collective(monkeypatch: pytest.MonkeyPatch):
    from stagemesh.stage_service.offload import engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "gather_into", lambda *a: calls.append(a))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = _model()
        want = _outputs(copy.deepcopy(model))
        engine = LayerwiseOffload(model, "cpu", group=dist.group.WORLD, use_allgather=True)
        assert all(torch.equal(a, b) for a, b in zip(_outputs(model), want))
    finally:
        dist.destroy_process_group()
    assert engine.stats().world == 1 and engine.stats().host_mode == "packed" and not calls

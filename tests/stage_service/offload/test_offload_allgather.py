"""DLO AllGather across real gloo process groups (2 and 3 ranks) on the CPU, streaming blocks
as stored and in FP8."""

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


def _check_fp8() -> dict:
    """Ranks shard the FP8 form (weights and scales) and rebuild the same blocks as a rank
    that streams its own complete FP8 blocks."""
    fp8 = torch.float8_e4m3fn
    sharded = _model()
    engine = LayerwiseOffload(sharded, "cpu", group=dist.group.WORLD, stream_dtype=fp8)
    local = _model()
    alone = LayerwiseOffload(local, "cpu", group=dist.group.WORLD, use_allgather=False, stream_dtype=fp8)
    stats = engine.stats()
    return {
        "equal_no_allgather": all(torch.equal(a, b) for a, b in zip(_outputs(sharded), _outputs(local))),
        "differs_from_resident": not torch.equal(_outputs(sharded)[0], _outputs(_model())[0]),
        "mode": stats.host_mode,
        "stream_dtype": stats.stream_dtype,
        "host_bytes": stats.host_bytes,
        "fp8_bytes": alone.stats().host_bytes,
        "model_bytes": LayerwiseOffload(_model(), "cpu", use_allgather=False).stats().host_bytes,
    }


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {"single": _check(rank, world, False), "list": _check(rank, world, True)}
        result["fp8"] = _check_fp8()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_allgather_equals_resident_and_no_allgather(world: int, tmp_path: Path):
    mp.spawn(_rank_main, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        f = result.pop("fp8")
        assert f["equal_no_allgather"] and f["differs_from_resident"], rank
        assert f["mode"] == "sharded" and f["stream_dtype"] == "float8_e4m3fn"
        # Each rank keeps 1/world of the FP8 bytes and scales (shards padded to equal size).
        assert f["host_bytes"] <= f["fp8_bytes"] / world + ALIGN * CFG.depth
        # float32 model: a quarter, plus scales, float32 biases and norms, alignment
        assert f["fp8_bytes"] < 0.35 * f["model_bytes"]
        for path, r in result.items():
            assert r["equal_resident"] and r["equal_no_allgather"], (rank, path)
            assert r["world"] == world and r["mode"] == "sharded"
            # Each rank keeps ~1/world of the weights: its shards, padded to equal size.
            assert r["host_bytes"] == r["expected_host"]
            assert r["host_bytes"] <= r["block_bytes"] / world + ALIGN * CFG.depth
    assert world != 3 or result["single"]["block"] % 3, "want a block that 3 does not divide"


def test_group_of_one_runs_no_collective(monkeypatch: pytest.MonkeyPatch):
    from stagemesh.stage_service.offload import streamer as streamer_module

    calls = []
    monkeypatch.setattr(streamer_module, "gather_into", lambda *a: calls.append(a))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = _model()
        want = _outputs(copy.deepcopy(model))
        engine = LayerwiseOffload(model, "cpu", group=dist.group.WORLD, use_allgather=True)
        assert all(torch.equal(a, b) for a, b in zip(_outputs(model), want))
    finally:
        dist.destroy_process_group()
    assert engine.stats().world == 1 and engine.stats().host_mode == "packed" and not calls

"""Sequence-parallel attention on real gloo ranks: Ulysses (heads divide by the ranks) and ring
(they do not), with and without shared tokens, with a sequence the ranks do not divide; the
whole output equals one process's scaled_dot_product_attention within float32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stagemesh.stage_service.models.parallel import Axis
from stagemesh.stage_service.models.sequence_parallel import Shard, attention
from tests.support.gloo_ranks import run_ranks

TOLERANCE = 1e-5  # float32: a different reduction order (all-to-all, log-sum-exp merge)


def _inputs(heads: int, tokens: int, shared: int):
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(3, 2, heads, shared + tokens, 8, generator=g)
    return qkv


def _reference(heads: int, tokens: int, shared: int) -> torch.Tensor:
    q, k, v = _inputs(heads, tokens, shared)
    return F.scaled_dot_product_attention(q, k, v)


def _rank_attention(rank: int, world: int, cases: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    import torch.distributed as dist

    axis = Axis(world, rank, dist.group.WORLD)
    wholes = []
    for heads, tokens, shared in cases:
        shard = Shard(axis, tokens)
        q, k, v = _inputs(heads, tokens, shared)
        mine = [shard.take(t[:, :, shared:], dim=2) for t in (q, k, v)]
        common = tuple(t[:, :, :shared] for t in (q, k, v)) if shared else None
        out, shared_out = attention(*mine, shard, common)
        whole = shard.gather(out, dim=2)
        if shared_out is not None:
            whole = torch.cat([shared_out, whole], dim=2)
        wholes.append(whole)
    return wholes


# (heads, tokens, shared tokens) per group size; one group of processes runs all its cases.
CASES = {
    # Ulysses; Ulysses with a padded slice and shared tokens
    2: [(4, 16, 0), (4, 15, 3)],
    # ring (4 heads, 3 ranks), padded; ring with one slice of padding alone, shared tokens
    3: [(4, 16, 0), (2, 4, 5)],
}


@pytest.mark.parametrize("world", sorted(CASES), ids=["ulysses", "ring"])
def test_split_attention_equals_whole(world):
    results = run_ranks(world, _rank_attention, CASES[world])
    for i, (heads, tokens, shared) in enumerate(CASES[world]):
        want = _reference(heads, tokens, shared)
        for rank, got in results.items():
            assert got[i].shape == want.shape
            assert (got[i] - want).abs().max().item() <= TOLERANCE, (rank, heads, tokens, shared)
        # Every rank ends with the same shared-token output (they stay replicated).
        first = results[0][i][:, :, :shared]
        assert all(torch.equal(r[i][:, :, :shared], first) for r in results.values())


def test_shard_pads_and_gathers_without_the_padding():
    shard = Shard(Axis(3, 2), 7)  # 3 per rank, 2 padded
    x = torch.arange(7.0)[None]
    assert shard.local == 3 and shard.padded == 9
    assert shard.take(x, 1).tolist() == [[6.0, 0.0, 0.0]]
    assert shard.valid_keys(2, torch.device("cpu")).tolist() == [True, False, False]
    assert shard.valid_keys(1, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="sequence of 6 tokens"):
        shard.take(x[:, :6], 1)
